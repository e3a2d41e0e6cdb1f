"""HTML pages of plans, plan diffs (and, in :mod:`dmuon.sim._pages.sim_html`, simulations): inline SVG,
inline styles, no JavaScript, no network (:mod:`dmuon.plan._tools.html.svg` has the rules).

Imported lazily by ``ShardingPlan._repr_html_`` / ``to_html``, ``PlanDiff._repr_html_`` /
``to_html`` and the ``--html`` options, so ``import dmuon.plan`` does not load it.
"""

from dmuon.plan._tools.html.plan_page import plan_html, plan_page

__all__ = ["plan_html", "plan_page"]
