"""Render HTML to PNG with headless Chromium: what ``tests/test_html_browser.py`` and
``docs/img/make_screenshots.py`` use to look at the pages in a real browser. Needs a Chromium
binary (Debian: ``apt-get install chromium``); nothing here is imported by the pages."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

__all__ = ["FLAGS", "find_chromium", "screenshot"]

#: flags that work headless as root in a container: no sandbox, GPU, network services or first-run UI
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)


def find_chromium() -> str | None:
    """Path of a Chromium binary: ``$DMUON_CHROMIUM``, ``chromium``, ``chromium-browser`` or
    ``google-chrome`` on the PATH; None when there is none."""
    for name in (os.environ.get("DMUON_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


def screenshot(
    html_path: str | os.PathLike,
    png_path: str | os.PathLike,
    *,
    width: int,
    height: int,
    chromium: str | None = None,
    timeout_s: float = 180,
) -> None:
    """One Chromium launch: load ``html_path`` in a ``width`` x ``height`` window (CSS pixels,
    scale 1) with a fresh profile and write the screenshot to ``png_path``.

    Raises:
        RuntimeError: no Chromium, or no screenshot written (the message holds Chromium's stderr).
    """
    exe = chromium or find_chromium()
    if exe is None:
        raise RuntimeError("headless Chromium not found (apt-get install -y chromium, or set DMUON_CHROMIUM)")
    png = pathlib.Path(png_path)
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="dmuon-chromium-") as profile:
        run = subprocess.run(
            [
                exe,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={png}",
                pathlib.Path(html_path).resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if not png.exists():
        raise RuntimeError(f"Chromium wrote no screenshot (exit {run.returncode}): {run.stderr[-2000:]}")
