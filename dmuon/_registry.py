"""The machinery that installs, checks and undoes what dmuon changes in other libraries.

Every change dmuon makes to an object it does not own is an :class:`Integration`, installed and
undone only through :func:`install` / :func:`uninstall`. When each is installed, the opt-out and
why this is a leaf: Note: the integration registry (docs/design.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
from typing import Any, Callable

__all__ = [
    "Integration",
    "IntegrationError",
    "INTEGRATIONS",
    "ENV_OPT_OUT",
    "MARKER",
    "install",
    "install_stage",
    "uninstall",
    "disable",
    "disabled",
    "installed",
    "status",
    "Status",
    "scoped",
    "check",
]

#: the environment variable that leaves every library untouched ("1", "true", "yes")
ENV_OPT_OUT = "DMUON_NO_PATCHES"
#: the attribute every dmuon wrapper carries: the name of its integration
MARKER = "__dmuon_wraps__"


class IntegrationError(RuntimeError):
    """A library's object no longer looks the way a dmuon integration relies on (a missing
    attribute, or other leading parameters): raised instead of wrapping it."""


@dataclasses.dataclass(frozen=True)
class Integration:
    """One change dmuon makes to another library's object.

    ``target`` is ``"module:attr"`` or ``"module:Class.attr"``; ``wrap`` is ``"module:factory"``,
    ``factory(original) -> wrapper``; ``expects`` the leading parameter names of the original the
    wrapper relies on (``"*"``: any name). ``kind="hook"``: ``wrap`` names ``install() -> handle``
    (an object with ``remove()``) instead, and ``target`` only what it hooks into. ``required``:
    False when a missing target (an older or newer library) simply means nothing to install.
    """

    name: str
    target: str
    wrap: str
    stage: str  # "import" | "dedicate"
    why: str
    expects: tuple[str, ...] = ()
    trigger: str | None = None  # module whose import installs it (after its stage)
    required: bool = True
    kind: str = "attr"  # "attr" | "hook"
    explicit: str = ""  # the patch-free way (docs/integrations.md)


_LOCK = threading.RLock()

#: every registered integration, in order (:func:`register`; ``dmuon.integrations._patches`` at ``import dmuon``)
INTEGRATIONS: tuple[Integration, ...] = ()
_BY_NAME: dict[str, Integration] = {}
#: short names accepted by :func:`install` for a family ("accelerate" -> its three entries)
_FAMILIES: dict[str, tuple[str, ...]] = {}


def register(integrations, families=None) -> None:
    """Add ``integrations`` to the list (in order) and ``families`` (short name -> entry names) to
    the names :func:`install` accepts. Registering the same entry again is a no-op; another entry
    under a registered name raises ``ValueError``."""
    global INTEGRATIONS
    with _LOCK:
        new = []
        for integ in integrations:
            known = _BY_NAME.get(integ.name)
            if known is None:
                new.append(integ)
                _BY_NAME[integ.name] = integ
            elif known != integ:
                raise ValueError(f"dmuon: integration {integ.name!r} is registered already, as {known}")
        INTEGRATIONS = INTEGRATIONS + tuple(new)
        for family, names in (families or {}).items():
            unknown = [n for n in names if n not in _BY_NAME]
            if unknown:
                raise ValueError(f"dmuon: family {family!r} names unregistered integrations {unknown}")
            _FAMILIES[family] = tuple(names)
        if not _DISABLED:  # an entry registered after its stage ran installs now
            for integ in new:
                if integ.stage in _STAGES_DONE:
                    _install_one(integ, _STAGE_REASON[integ.stage])


@dataclasses.dataclass
class _Installed:
    owner: Any  # the module or class holding the attribute (attr kind)
    attr: str
    original: Any
    own: bool  # the attribute was in owner.__dict__ (else inherited: undo deletes it)
    wrapper: Any
    handle: Any = None  # hook kind
    reason: str = ""


_STAGE_REASON = {"import": "import dmuon", "dedicate": "first dmuon.dedicate_params / dmuon.exec.apply"}
_INSTALLED: dict[str, _Installed] = {}
_SKIPPED: dict[str, str] = {}  # name -> why it is not installed (absent target, pending import)
_STAGES_DONE: set[str] = set()
_DISABLED = os.environ.get(ENV_OPT_OUT, "").strip().lower() in ("1", "true", "yes", "on")


def disabled() -> bool:
    """Whether automatic installs are off (``DMUON_NO_PATCHES`` or :func:`disable`)."""
    return _DISABLED


def installed(name: str) -> bool:
    return name in _INSTALLED


# ----------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------


def _split(target: str) -> tuple[str, str, str]:
    module, _, path = target.partition(":")
    owner, _, attr = path.rpartition(".")
    return module, owner, attr


def _resolve_owner(integ: Integration, import_module: bool = True):
    """The object holding the target attribute, or None if its module / class is absent."""
    module_name, owner_path, _ = _split(integ.target)
    if import_module:
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            return None
    else:
        obj = sys.modules.get(module_name)
        if obj is None:
            return None
    for part in filter(None, owner_path.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _current(owner, attr: str):
    """The attribute as stored (a class's own ``__dict__`` entry, so staticmethods etc. stay raw)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                return klass.__dict__[attr]
        return None
    return getattr(owner, attr, None)


def _factory(spec: str) -> Callable:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def check(integ: Integration | str, original: Any = None) -> None:
    """Raise :class:`IntegrationError` if ``integ``'s target (or ``original``) lacks the leading
    parameters its wrapper relies on."""
    integ = _BY_NAME[integ] if isinstance(integ, str) else integ
    if original is None:
        if integ.kind == "hook" and not integ.expects:
            return
        owner = _resolve_owner(integ)
        original = None if owner is None else _current(owner, _split(integ.target)[2])
        if original is None:
            raise IntegrationError(
                f"dmuon integration {integ.name!r}: {integ.target} is missing on this version; {_opt_out_hint(integ)}"
            )
    if not integ.expects:
        return
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError) as exc:
        raise IntegrationError(
            f"dmuon integration {integ.name!r}: cannot read the signature of {integ.target}; {_opt_out_hint(integ)}"
        ) from exc
    want = list(integ.expects)
    got = params[: len(want)]
    if len(got) < len(want) or any(w != "*" and w != g for w, g in zip(want, got)):
        raise IntegrationError(
            f"dmuon integration {integ.name!r}: {integ.target}{inspect.signature(original)} no longer takes "
            f"({', '.join(want)}, ...) as dmuon's wrapper relies on (a library upgrade changed it); "
            f"{_opt_out_hint(integ)}"
        )


def _opt_out_hint(integ: Integration) -> str:
    return (
        f"dmuon does not install it. Set {ENV_OPT_OUT}=1 (or call dmuon.integrations.disable()) and use the "
        f"explicit path instead: {integ.explicit or 'docs/integrations.md'} (docs/integrations.md, 'Without patches')"
    )


# ----------------------------------------------------------------------------------------------
# Install / undo
# ----------------------------------------------------------------------------------------------


def _install_one(integ: Integration, reason: str) -> bool:
    if integ.name in _INSTALLED:
        return True
    if integ.kind == "hook":
        if integ.expects:
            check(integ)
        handle = _factory(integ.wrap)()
        _INSTALLED[integ.name] = _Installed(None, "", None, False, None, handle=handle, reason=reason)
        _SKIPPED.pop(integ.name, None)
        return True
    if integ.trigger is not None and integ.trigger not in sys.modules:
        _SKIPPED[integ.name] = f"waits for `import {integ.trigger.split('.')[0]}`"
        return False
    owner = _resolve_owner(integ, import_module=integ.trigger is None)
    attr = _split(integ.target)[2]
    original = None if owner is None else _current(owner, attr)
    if original is None:
        if integ.required:
            check(integ)  # raises the named error
        _SKIPPED[integ.name] = "target absent in this version (nothing to wrap)"
        return False
    if getattr(original, MARKER, None) == integ.name:  # someone else's record of ours: adopt
        return True
    check(integ, original)
    wrapper = _factory(integ.wrap)(original)
    setattr(wrapper, MARKER, integ.name)
    wrapper.__wrapped__ = original
    own = not isinstance(owner, type) or attr in owner.__dict__
    setattr(owner, attr, wrapper)
    _INSTALLED[integ.name] = _Installed(owner, attr, original, own, wrapper, reason=reason)
    _SKIPPED.pop(integ.name, None)
    return True


def _names(names) -> list[str]:
    out = []
    for n in names:
        for m in _FAMILIES.get(n, (n,)):
            if m not in _BY_NAME:
                raise KeyError(f"dmuon: no integration {m!r}; known: {sorted(_BY_NAME)} and {sorted(_FAMILIES)}")
            out.append(m)
    return out


def install(*names: str, reason: str = "explicit dmuon.integrations.enable()") -> list[str]:
    """Install the named integrations (a name of :data:`INTEGRATIONS` or a family: ``"fsdp2"``,
    ``"clip"``, ``"amp"``, ``"dcp"``, ``"ddp"``, ``"optimizer"``, ``"accelerate"``, ``"trainer"``),
    even when automatic installs are disabled. Idempotent. A triggered integration (accelerate,
    transformers) imports its library now. Returns the names installed."""
    done = []
    with _LOCK:
        for name in _names(names):
            integ = _BY_NAME[name]
            if integ.trigger is not None and integ.trigger not in sys.modules:
                try:
                    importlib.import_module(integ.trigger)
                except ImportError:
                    _SKIPPED[name] = f"{integ.trigger} is not installed"
                    continue
            if _install_one(integ, reason):
                done.append(name)
    return done


def install_stage(stage: str) -> None:
    """The automatic installs: ``"import"`` (``import dmuon``) or ``"dedicate"`` (the first
    dedication, which also covers the import stage). No-op when :func:`disabled`; idempotent (a
    stage runs once: what :func:`uninstall` removed afterwards stays removed)."""
    if _DISABLED:
        return
    stages = ("import",) if stage == "import" else ("import", "dedicate")
    with _LOCK:
        for s in stages:
            if s in _STAGES_DONE:
                continue
            _STAGES_DONE.add(s)
            for integ in INTEGRATIONS:
                if integ.stage == s:
                    _install_one(integ, _STAGE_REASON[s])


def _on_import(module_name: str) -> None:
    with _LOCK:
        if "import_hook" not in _INSTALLED:
            return
        for integ in INTEGRATIONS:
            if integ.trigger == module_name:
                _install_one(integ, f"import {module_name} after the first dedication")


def uninstall(*names: str) -> list[str]:
    """Undo the named integrations (all when none named): every original object back in place
    (identity). Returns the names undone. The automatic installs do not run again for a stage
    already done."""
    with _LOCK:
        todo = _names(names) if names else [i.name for i in reversed(INTEGRATIONS)]
        undone = []
        for name in todo:
            rec = _INSTALLED.pop(name, None)
            if rec is None:
                continue
            if rec.handle is not None:
                rec.handle.remove()
            elif _current(rec.owner, rec.attr) is rec.wrapper or getattr(rec.owner, rec.attr, None) is rec.wrapper:
                if rec.own:
                    setattr(rec.owner, rec.attr, rec.original)
                else:
                    delattr(rec.owner, rec.attr)
            else:  # someone re-wrapped it since: leave their object, report ours as gone
                pass
            undone.append(name)
        return undone


@contextlib.contextmanager
def scoped(*names: str):
    """The named integrations installed for the duration of the block (those not installed before
    are undone after): e.g. the ``fully_shard`` skip around accelerate's ``prepare`` when the
    automatic installs are disabled but accelerate was enabled explicitly."""
    added = [n for n in _names(names) if n not in _INSTALLED]
    install(*added, reason="for the duration of a call (scoped)")
    try:
        yield
    finally:
        undo = [n for n in added if n in _INSTALLED]
        if undo:  # (uninstall() without names would undo everything)
            uninstall(*undo)


def disable() -> list[str]:
    """Undo every integration and block the automatic installs (the same as ``DMUON_NO_PATCHES=1``
    from here on). Returns the names undone."""
    global _DISABLED
    with _LOCK:
        _DISABLED = True
        return uninstall()


# ----------------------------------------------------------------------------------------------
# Status
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Status:
    name: str
    target: str
    stage: str
    installed: bool
    why: str  # why it is (or is not) installed
    what: str  # what it does

    def __str__(self) -> str:
        return f"{self.name:26} {'yes' if self.installed else 'no':4} {self.target}  ({self.why})"


class StatusTable(list):
    """A list of :class:`Status` records that prints as a table."""

    def __str__(self) -> str:
        head = f"{'integration':26} {'on':4} target  (why)"
        return "\n".join([head] + [str(s) for s in self])


def status() -> StatusTable:
    """One record per integration: installed or not, and why."""
    out = StatusTable()
    with _LOCK:
        for integ in INTEGRATIONS:
            rec = _INSTALLED.get(integ.name)
            if rec is not None:
                why = f"installed by {rec.reason}"
            elif _DISABLED:
                why = f"disabled ({ENV_OPT_OUT} or dmuon.integrations.disable())"
            elif integ.name in _SKIPPED:
                why = _SKIPPED[integ.name]
            elif integ.stage in _STAGES_DONE:
                why = "uninstalled"
            elif integ.stage == "import":
                why = "installs at import dmuon"
            else:
                why = "installs at the first dmuon.dedicate_params"
            out.append(Status(integ.name, integ.target, integ.stage, rec is not None, why, integ.why))
    return out


# ----------------------------------------------------------------------------------------------
# The post-import finder (the "import_hook" integration)
# ----------------------------------------------------------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Installs the integrations triggered by a module right after that module is executed."""

    def find_spec(self, fullname, path, target=None):
        if not any(i.trigger == fullname for i in INTEGRATIONS):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            _on_import(fullname)

        loader.exec_module = exec_and_install
        return spec


class _FinderHandle:
    def __init__(self, finder):
        self.finder = finder

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self.finder)
        except ValueError:
            pass


def _install_finder() -> _FinderHandle:
    """Libraries already imported are handled by the stage that installs this (their entries come
    after this one in :data:`INTEGRATIONS`); later imports by the finder."""
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return _FinderHandle(finder)
