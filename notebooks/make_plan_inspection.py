"""Write notebooks/plan_inspection.ipynb (outputs cleared) with nbformat.

Run from the repository root:  python notebooks/make_plan_inspection.py
The notebook itself is executed by tests/test_notebook.py.
"""

from __future__ import annotations

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell(
        "# Inspecting a DMuon sharding plan\n\n"
        "`dmuon.plan.compile` is pure: it reads a (meta-device) model's names, shapes and dtypes and "
        "returns a frozen `ShardingPlan`: one owner rank per Muon matrix (constrained LPT, "
        "Graham 1969), the hook boundary (transformer block) whose hooks broadcast it, and the packed "
        "buffer layout. No GPU and no process group are needed. See `docs/planning.md`."
    ),
    new_code_cell(
        "import io\n"
        "import matplotlib\n"
        "matplotlib.use('Agg')\n"
        "import matplotlib.pyplot as plt\n"
        "from IPython.display import Image, display\n"
        "\n"
        "import dmuon.plan as P\n"
        "from dmuon.sim import zoo\n"
        "\n"
        "model = zoo.llama3_8b()          # meta device: nothing is allocated\n"
        "plan = P.compile(model, 8)             # 1-D mesh of 8 ranks, DMuon-Z3\n"
        "print(plan.summary(max_rows=8))"
    ),
    new_markdown_cell(
        "## The plan's page\n\n"
        "A plan displays itself (`plan._repr_html_()`, the same page as `plan.to_html()` and "
        "`python -m dmuon plan ... --html FILE`): the header card with the balance against the LPT bound, "
        "the ownership map (hook boundaries x ranks, coloured by the elements each rank owns; hover a cell "
        "for what it holds), per-rank bars (load, resident and transient bytes, bytes per step, with the "
        "mean, the LPT bound and FSDP2 + naive Muon), bytes per phase, collectives per boundary and the step "
        "schedule by phase (the listing folded). Inline SVG, no JavaScript; `plan.summary()` is the text form."
    ),
    new_code_cell("display(plan)"),
    new_markdown_cell(
        "## Owners and boundaries\n\n"
        "`plan.owner(fqn)` gives `Owner(shard, replicate, rank)`; `plan.boundary(fqn)` the module whose "
        "pre-forward hook broadcasts the parameter. Each Llama layer's 7 matrices land on 7 distinct ranks."
    ),
    new_code_cell(
        "for fqn in plan.dedicated[:7]:\n"
        "    o = plan.owner(fqn)\n"
        "    print(f'{fqn:45s} rank {o.rank}  boundary {plan.boundary(fqn)}  matrix {plan.param(fqn).matrix_shape}')\n"
        "\n"
        "layer0 = {plan.owner(f).rank for f in plan.dedicated if plan.boundary(f) == 'model.layers.0'}\n"
        "assert len(layer0) == 7, layer0\n"
        "print('layer 0 owners:', sorted(layer0))\n"
        "print('not dedicated:', [n for n, _ in model.named_parameters() if not plan.is_dedicated(n)][:4], '...')"
    ),
    new_markdown_cell(
        "## Packed buffer of one boundary\n\n"
        "One buffer per parameter dtype; one segment per owning shard coordinate; entries aligned to "
        "`align_numel` elements, followed by one gradient-presence flag per entry."
    ),
    new_code_cell(
        "boundary = plan.boundary_record('model.layers.0.mlp.up_proj.weight')\n"
        "for buf in boundary.buffers:\n"
        "    print(f'buffer {buf.dtype}: {buf.numel:,} elements')\n"
        "    for seg in buf.segments:\n"
        "        for sub in seg.subsegments:\n"
        "            names = ', '.join(e.fqn.rsplit('.', 2)[-2] for e in sub.entries)\n"
        "            print(f'  shard {seg.shard} (rank {sub.owner.rank}) @ {sub.offset:>11,}  numel {sub.numel:>11,}  '\n"
        "                  f'flags @ {sub.flags_offset:,}  [{names}]')"
    ),
    new_markdown_cell(
        "## Per-rank load\n\n"
        "Owned elements per rank against the mean and the proven LPT bound `total/ranks + largest`, "
        "and communication per rank against FSDP2 + naive all-gather Muon."
    ),
    new_code_cell(
        "def plot_load(plan, title):\n"
        "    stats, base = plan.rank_stats(), plan.baseline_rank_stats()\n"
        "    ranks = [s.rank for s in stats]\n"
        "    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))\n"
        "    a.bar(ranks, [s.owned_numel / 1e6 for s in stats], color='tab:blue')\n"
        "    mean = sum(plan.owned_numel) / plan.world_size / 1e6\n"
        "    a.axhline(mean, color='k', ls='--', label='mean')\n"
        "    a.axhline(plan.balance_bound / 1e6, color='tab:red', ls=':', label='LPT bound') if plan.cost_model == 'numel' else None\n"
        "    a.set(xlabel='mesh rank', ylabel='owned elements (M)', title=title)\n"
        "    a.set_ylim(0, 1.3 * max(plan.balance_bound, max(plan.owned_numel)) / 1e6)\n"
        "    a.legend(loc='upper center', ncol=2, fontsize=8)\n"
        "    b.bar(ranks, [s.comm_nbytes / 2**30 for s in stats], label='DMuon')\n"
        "    b.plot(ranks, [s.comm_nbytes / 2**30 for s in base], 'r_', ms=14, label='FSDP2 + naive Muon')\n"
        "    b.set(xlabel='mesh rank', ylabel='GiB per step', title='bytes charged per rank')\n"
        "    b.set_ylim(0, 1.3 * max(s.comm_nbytes for s in base) / 2**30)\n"
        "    b.legend(loc='upper center', ncol=2, fontsize=8)\n"
        "    fig.tight_layout()\n"
        "    png = io.BytesIO()\n"
        "    fig.savefig(png, format='png', dpi=80)\n"
        "    plt.close(fig)\n"
        "    display(Image(png.getvalue()))\n"
        "\n"
        "plot_load(plan, 'Llama-3-8B, N=8')\n"
        "plot_load(P.compile(model, (2, 8)), 'Llama-3-8B, HSDP 2x8')"
    ),
    new_markdown_cell(
        "## What you decide on: Newton-Schulz FLOPs and resident bytes per rank\n\n"
        "Three ways to train the same matrices: **dmuon** (each matrix's owner alone runs NS and keeps "
        "its master + momentum), **FSDP2 + naive Muon** (every rank all-gathers every gradient and runs "
        "NS on all of them; FSDP2 shards of parameters and momentum), and **FSDP2 + AdamW** (no NS; "
        "shards of parameters, `exp_avg`, `exp_avg_sq`: 3x the parameter shard). Resident bytes: the "
        "dedicated matrices' parameters + optimizer state held between steps, fp32 "
        "(`RankStats.resident_nbytes`; AdamW: 3 x the FSDP2 shard). Ranks are sorted by their value, so "
        "the curves show the spread (FSDP2's are flat: every rank does the same). At scale there are "
        "fewer matrices than ranks: Llama-3-70B has 560 (80 layers x 7) for 1024 ranks (HSDP 8x128), "
        "Llama-3-405B 882 for 1024, so hundreds of ranks own nothing (no NS, nothing resident), "
        "the busiest rank sets the step, and the memory is uneven: compare its maximum with the "
        "FSDP2 baselines' flat line."
    ),
    new_code_cell(
        "def per_rank(plan):\n"
        "    s, b = plan.rank_stats(), plan.baseline_rank_stats()\n"
        "    return {\n"
        "        'dmuon': ([r.ns_flops for r in s], [r.resident_nbytes for r in s]),\n"
        "        'FSDP2 + naive Muon': ([r.ns_flops for r in b], [r.resident_nbytes for r in b]),\n"
        "        'FSDP2 + AdamW': ([0 for r in b], [3 * r.owned_nbytes for r in b]),\n"
        "    }\n"
        "\n"
        "def plot_decision(cases):\n"
        "    fig, axes = plt.subplots(len(cases), 2, figsize=(11, 3.2 * len(cases)), squeeze=False)\n"
        "    for (title, plan), (fl, mem) in zip(cases, axes):\n"
        "        for name, (flops, nbytes) in per_rank(plan).items():\n"
        "            x = range(len(flops))\n"
        "            if any(flops):\n"
        "                fl.plot(x, sorted([f / 1e12 for f in flops], reverse=True), label=name)\n"
        "            mem.plot(x, sorted([n / 2**30 for n in nbytes], reverse=True), label=name)\n"
        "        fl.set(yscale='log', xlabel='ranks, sorted', ylabel='NS TFLOP per step', title=title)\n"
        "        mem.set(xlabel='ranks, sorted', ylabel='resident GiB (matrices + state)', title=title)\n"
        "        fl.legend(fontsize=8); mem.legend(fontsize=8)\n"
        "        s = plan.rank_stats()\n"
        "        idle = sum(r.ns_flops == 0 for r in s)\n"
        "        mean = sum(r.resident_nbytes for r in s) / len(s)\n"
        '        print(f"{title}: {len(s)} ranks, {idle} own nothing; busiest NS {max(r.ns_flops for r in s) / 1e12:,.1f} "\n'
        '              f"TFLOP vs naive {max(r.ns_flops for r in plan.baseline_rank_stats()) / 1e12:,.1f}; "\n'
        '              f"resident max/mean {max(r.resident_nbytes for r in s) / mean:.2f}")\n'
        "    fig.tight_layout()\n"
        "    png = io.BytesIO()\n"
        "    fig.savefig(png, format='png', dpi=70)\n"
        "    plt.close(fig)\n"
        "    display(Image(png.getvalue()))\n"
        "\n"
        "plot_decision([('Llama-3-8B, N=8', plan)])"
    ),
    new_code_cell(
        "# At scale (planning only, meta device; ~1 minute on a laptop core)\n"
        "plan_70b = P.compile(zoo.llama3_70b(), (8, 128))    # HSDP: 8 replicas x 128 shards\n"
        "plan_405b = P.compile(zoo.llama3_405b(), 1024)\n"
        "plot_decision([('Llama-3-70B, HSDP 8x128', plan_70b), ('Llama-3-405B, N=1024', plan_405b)])"
    ),
    new_markdown_cell(
        "### Owner groups: past one matrix per rank\n\n"
        "`owner_groups='auto'` lets `k` shard ranks of one replicate row own a matrix as blocks along "
        "its long side (sharded Gram NS over them; `docs/owner_groups.md`) where one owner per matrix "
        "cannot balance the mesh. The same two meshes: no rank owns nothing, the busiest rank's NS and "
        "resident bytes come down to near the mean. The summary says it in words."
    ),
    new_code_cell(
        "plan_70b_g = P.compile(zoo.llama3_70b(), (8, 128), owner_groups='auto')\n"
        "plan_405b_g = P.compile(zoo.llama3_405b(), 1024, owner_groups='auto')\n"
        "plot_decision([('Llama-3-70B, HSDP 8x128, owner groups', plan_70b_g),\n"
        "               ('Llama-3-405B, N=1024, owner groups', plan_405b_g)])\n"
        "print('\\n'.join(l for l in plan_405b.summary().splitlines() if l.startswith(('ownership', 'owner groups'))))\n"
        "print('\\n'.join(l for l in plan_405b_g.summary().splitlines() if l.startswith(('ownership', 'owner groups'))))\n"
        "print(P.diff(plan_405b, plan_405b_g).render(max_lines=3))"
    ),
    new_markdown_cell(
        "The page of a 1,024-rank plan aggregates: a column of the ownership map is 8 consecutive ranks "
        "(mean per rank), a row 2 consecutive boundaries, and the picture says so. Owner-group blocks are "
        "orange, single owners blue."
    ),
    new_code_cell("display(plan_405b_g)"),
    new_markdown_cell("## Diffs\n\nPlans are compared by FQN; this works across mesh sizes and modes."),
    new_code_cell(
        "z2 = P.compile(model, 8, reshard_after_forward=False)\n"
        "d = P.diff(plan, z2)\n"
        "print(d)\n"
        "assert not d.changes and d.cost_delta('backward_broadcast_nbytes') < 0"
    ),
    new_code_cell(
        "p16 = P.compile(model, 16)\n"
        "d = P.diff(plan, p16)\n"
        "print(d.render(max_lines=10))\n"
        "print(len(d.owners_moved), 'of', len(plan.dedicated), 'owners moved')"
    ),
    new_markdown_cell(
        "A diff displays itself too (`d.to_html()`, `python -m dmuon diff a.json b.json --html FILE`): both "
        "ownership maps on one colour scale with the changed owners outlined, bytes per phase and per boundary "
        "before and after. Here the meshes differ (8 -> 16 ranks), so rank numbers do not correspond: "
        "boundaries are matched by FQN and the per-rank figures compared as sorted distributions. On one mesh "
        "(below: the `ns_flops` cost model against `numel`) the page draws each rank's change."
    ),
    new_code_cell("display(d)\ndisplay(P.diff(plan, P.compile(model, 8, cost_model='ns_flops')))"),
    new_code_cell(
        "hsdp = P.compile(model, (2, 8))\n"
        "d = P.diff(plan, hsdp)\n"
        "print(d.render(max_lines=5))\n"
        "print('replicate phases (bytes/step):', hsdp.cost.replicate_reduce_nbytes, hsdp.cost.replicate_broadcast_nbytes)"
    ),
    new_markdown_cell(
        "## Tensor parallelism\n\n"
        "`tp=P.TPPolicy(size=..., shard_dims=...)` plans TP on the unparallelised meta model (Megatron-style dims from "
        "`dmuon.plan.megatron_tp_shard_dims`). Each matrix is orthogonalised by its owner's TP group, "
        "either by Gram NS (fp32 `(d, d)` all-reduces) or by gathering it; `TPPolicy(ns='auto')` (the default) picks the "
        "fewer bytes. The diff compares the two choices by FQN. See `docs/tensor_parallel.md`."
    ),
    new_code_cell(
        "dims = P.megatron_tp_shard_dims(model)\n"
        "tp_auto = P.compile(model, 8, tp=P.TPPolicy(size=8, shard_dims=dims))\n"
        "tp_gram = P.compile(model, 8, tp=P.TPPolicy(size=8, shard_dims=dims, ns='gram'))\n"
        "for name, p in (('auto', tp_auto), ('gram', tp_gram)):\n"
        "    flops = [r.ns_flops for r in p.rank_stats()]\n"
        '    print(f"{name:>5}: TP bytes/step {p.cost.tp_nbytes / 2**30:7.1f} GiB, busiest rank "\n'
        '          f"{p.cost.max_rank_nbytes / 2**30:5.2f} GiB, NS per rank <= {max(flops) / 1e12:5.1f} TFLOP")\n'
        "print(P.diff(tp_auto, tp_gram).render(max_lines=4))\n"
        "assert {s.tp_ns for s in tp_auto.params} == {'gather'} and tp_gram.cost.tp_nbytes > tp_auto.cost.tp_nbytes"
    ),
    new_markdown_cell(
        "## The step schedule\n\n"
        "`plan.schedule()` is the nominal step as data: every rank's ops in issue order (broadcasts, "
        "reduces, HSDP replicate phases, TP collectives, Newton-Schulz, and the boundary's own compute as "
        "external ops). `plan.cost` is summed from it, the runtime issues exactly these collectives, and "
        "`check()` replays every rank's list for deadlock. Below: the first boundary's ops on rank 0 and "
        "on the busiest rank of an HSDP plan (see `docs/planning.md`, *The step schedule*)."
    ),
    new_code_cell(
        "hsdp = P.compile(model, (2, 4))\n"
        "sched = hsdp.schedule()\n"
        "sched.check()\n"
        "per_rank = hsdp.cost.per_rank_nbytes\n"
        "busiest = max(range(len(per_rank)), key=per_rank.__getitem__)\n"
        "first = hsdp.boundaries[0].fqn\n"
        "for rank in (0, busiest):\n"
        "    print(f'rank {rank}: {len(sched.rank_ops(rank))} ops, {per_rank[rank] / 2**30:.2f} GiB charged per step')\n"
        "    print(sched.summary(rank, boundary=first))\n"
        "assert all(sched.rank_nbytes(r) == per_rank[r] for r in range(sched.num_ranks))"
    ),
    new_markdown_cell(
        "## Simulated step: a Gantt chart\n\n"
        "`dmuon.sim.simulate` replays the schedule on a hardware model (here the H100 preset: NVLink inside "
        "a node, InfiniBand between nodes, bf16 tensor cores) with a workload derived from the plan "
        "(`dmuon.sim.from_plan`: matmul and attention FLOPs per boundary for the given tokens). Each rank "
        "has a compute lane and one lane per kind of collective; a collective starts when every member "
        "has issued it. Below: rank 0 of Llama-3-8B on 8 GPUs, 4,096 tokens per GPU, for FSDP2 + AdamW, "
        "dmuon Z3 and the naive all-gather Muon (see `docs/performance.md`, *Step-time simulator*). The result "
        "(a dict of `Simulation`s) draws itself in SVG: the `--png` Gantt chart without matplotlib."
    ),
    new_code_cell(
        "from types import SimpleNamespace\n"
        "import dmuon.sim as S\n"
        "\n"
        "bf16 = SimpleNamespace(param_dtype='bfloat16', reduce_dtype='float32')\n"
        "p8 = P.compile(model, 8, mp_policy=bf16, cost_model='ns_flops')\n"
        "hw = S.hardware.preset('h100')\n"
        "wl = S.from_plan(p8, tokens_per_rank=4096, seq_len=4096)\n"
        "sims = S.simulate_variants(p8, hw, wl, variants=('adamw', 'z3', 'naive'), timeline_ranks=(0,))\n"
        "for v, s in sims.items():\n"
        "    print(s.summary())\n"
        "assert sims['adamw'].step_s < sims['z3'].step_s < sims['naive'].step_s\n"
        "sims   # draws itself: the figures and rank 0's timeline per variant (sims.to_html(); simulate --html)"
    ),
    new_markdown_cell(
        "## Mixture-of-Experts\n\n"
        "3-D expert stacks (here Qwen3-30B-A3B's fused `gate_up_proj` `(128, 1536, 2048)` and `down_proj` "
        "`(128, 2048, 768)` in every layer) are dedicated by default: every expert is its own Muon matrices "
        "(gate and up split) and a stack's experts are owned in contiguous ranges that fill every rank to the "
        "same level after the dense matrices (the mean within one expert; a stack on one or two consecutive "
        "ranks, so few broadcasts; each buffer's collective is chosen by `collectives='auto'`). Before "
        "(`experts='off'` with `matrix_predicate`: each stack one parameter "
        "with one owner) the largest owner carries whole stacks. See `docs/moe.md` and docs/planning.md, "
        '"Collectives per buffer".'
    ),
    new_code_cell(
        "qwen = zoo.qwen3_30b_a3b()\n"
        "after = P.compile(qwen, 64)\n"
        "before = P.compile(qwen, 64, predicate=P.matrix_predicate(qwen), experts='off')\n"
        "print('\\n'.join(after.expert_lines()))\n"
        "for name, p in (('before: one owner per stack', before), ('after: expert ranges', after)):\n"
        "    owned = p.owned_numel\n"
        "    calls = sum(1 for op in p.schedule().rank_ops(0) if op.kind in ('broadcast', 'all_gather'))\n"
        "    print(f'{name}: owned max/mean {max(owned) / (sum(owned) / len(owned)):.2f}, '\n"
        "          f'{calls:,} broadcasts / all-gathers per rank and step')\n"
        "owners = after.expert_owners('model.layers.0.mlp.experts.gate_up_proj')  # one Owner per expert\n"
        "print(f'layer 0 gate_up_proj: {len(owners)} experts on {len({o.rank for o in owners})} ranks, expert 0 on rank {owners[0].rank}')"
    ),
    new_markdown_cell(
        "Its page: expert ranges are green in the ownership map, and the experts section colours each rank by "
        "the first expert it owns, so contiguous ranges read as a gradient along the ranks."
    ),
    new_code_cell("display(after)"),
    new_markdown_cell(
        "## Round trip and fingerprint\n\nPlans serialise losslessly; ranks compare fingerprints at apply time."
    ),
    new_code_cell(
        "text = plan.to_json()\n"
        "again = P.ShardingPlan.from_json(text)\n"
        "assert again == plan and again.fingerprint() == plan.fingerprint()\n"
        "print(len(text), 'characters of JSON; fingerprint', plan.fingerprint()[:16])\n"
        "again   # the page again, from the JSON"
    ),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main() -> None:
    path = pathlib.Path(__file__).with_name("plan_inspection.ipynb")
    nb = build()
    nbformat.validate(nb)
    nbformat.write(nb, str(path))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
