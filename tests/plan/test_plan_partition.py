"""Property tests of the constrained LPT owner assignment (dmuon/plan/_ownership/partition.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dmuon.plan._ownership.partition import lpt_partition

SETTINGS = settings(max_examples=150, deadline=None, database=None)


def _boundary_items(sizes, max_items: int) -> tuple[list[str], list[str]]:
    """FQN-like keys ``layers.g.pj`` and their boundary ``layers.g``, ``sizes[g]`` items per
    boundary, the first ``max_items``."""
    keys, groups = [], []
    for g, k in enumerate(sizes):
        for j in range(k):
            keys.append(f"layers.{g}.p{j}")
            groups.append(f"layers.{g}")
    return keys[:max_items], groups[:max_items]


@st.composite
def instances(draw, *, equal_weights: bool = False, max_items: int = 40):
    """(weights, keys, groups, R, N): random items with FQN-like keys grouped by boundary."""
    R = draw(st.integers(1, 3))
    N = draw(st.integers(1, 6))
    n_groups = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.integers(1, 7), min_size=n_groups, max_size=n_groups))
    keys, groups = _boundary_items(sizes, max_items)
    if equal_weights:
        w = draw(st.integers(1, 1000))
        weights = [w] * len(keys)
    else:
        weights = draw(st.lists(st.integers(0, 10**6), min_size=len(keys), max_size=len(keys)))
    return weights, keys, groups, R, N


@SETTINGS
@given(instances())
def test_every_item_gets_exactly_one_valid_slot(inst):
    weights, keys, groups, R, N = inst
    res = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    assert len(res.slots) == len(keys)
    assert all(0 <= s < R * N for s in res.slots)
    loads = [0] * (R * N)
    for w, s in zip(weights, res.slots):
        loads[s] += w
    assert tuple(loads) == res.loads


@SETTINGS
@given(instances())
def test_list_scheduling_bound(inst):
    """max load <= total/slots + w_max (Graham 1969 bound, proof in the partition docstring)."""
    weights, keys, groups, R, N = inst
    res = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    S = R * N
    # exact integer form of max <= total/S + w_max
    assert res.max_load * S <= sum(weights) + S * max(weights)
    assert res.bound == (sum(weights) + S * max(weights), S)


@SETTINGS
@given(instances(), st.randoms(use_true_random=False))
def test_deterministic_and_input_order_independent(inst, rnd):
    weights, keys, groups, R, N = inst
    res = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    again = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    assert res == again
    perm = list(range(len(keys)))
    rnd.shuffle(perm)
    shuffled = lpt_partition(
        [weights[i] for i in perm],
        [keys[i] for i in perm],
        [groups[i] for i in perm],
        num_shards=N,
        num_replicas=R,
    )
    by_key = dict(zip(keys, res.slots))
    assert {keys[i]: s for i, s in zip(perm, shuffled.slots)} == by_key
    assert shuffled.loads == res.loads


@SETTINGS
@given(instances(equal_weights=True))
def test_equal_weights_contiguous_groups_round_robin(inst):
    """Proved in the partition docstring: equal positive weights, groups contiguous in (-w, fqn)
    order -> the t-th item (sorted order) goes to slot t mod S."""
    weights, keys, groups, R, N = inst
    # keys "layers.{g}.p{j}" with g < 10 and j < 10 sort group-contiguously
    res = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    for t, i in enumerate(order):
        assert res.slots[i] == t % (R * N)


@SETTINGS
@given(instances(equal_weights=True))
def test_equal_weights_groups_up_to_n_items_are_spread(inst):
    """Corollary: a boundary with k <= N equal-weight items uses k distinct shard coordinates."""
    weights, keys, groups, R, N = inst
    res = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    for g in set(groups):
        coords = [res.slots[i] % N for i in range(len(keys)) if groups[i] == g]
        if len(coords) <= N:
            assert len(set(coords)) == len(coords)
        else:
            assert set(coords) == set(range(N))


@SETTINGS
@given(instances(equal_weights=True))
def test_hsdp_every_slot_gets_work_with_enough_equal_items(inst):
    weights, keys, groups, R, N = inst
    res = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    if len(keys) >= R * N:
        assert set(res.slots) == set(range(R * N))
    # loads never differ by more than one item of equal weight
    assert max(res.loads) - min(res.loads) <= weights[0]


def test_spread_is_not_guaranteed_for_interleaved_groups():
    """Documented limit: with a boundary's items interleaved with others in the sorted order
    (only possible for nested boundaries), a shard coordinate can repeat."""
    # N=2, equal weights; sorted order k0(X) k1(Y) k2(Z) k3(Y):
    # k0 -> 0 [1,0]; k1 -> 1 [1,1]; k2 -> 0 [2,1];
    # k3: Y used {1}, e = slot 0 with 2+1=3 > max(M=2, load[g]+W=1+1=2) -> refused, g = slot 1.
    res = lpt_partition([1] * 4, ["k0", "k1", "k2", "k3"], ["X", "Y", "Z", "Y"], num_shards=2)
    assert res.slots == (0, 1, 0, 1)  # Y's two items both on shard coordinate 1


def test_hand_example_not_optimal():
    """Docstring example: weights 5,3,3,2 on 2 slots, the 3s share a boundary -> makespan 8 (optimum 7)."""
    res = lpt_partition([5, 3, 3, 2], ["c", "a", "b", "d"], ["y", "x", "x", "y"], num_shards=2)
    # c(5)->0; a(3)->1; b: e=0 since 5+3 <= max(5, 3+5); d: e=1
    assert res.slots == (0, 1, 0, 1)
    assert res.loads == (8, 5)


def test_large_weights_use_exact_integers():
    w = [2**61, 2**61, 3, 5]
    res = lpt_partition(w, ["a", "b", "c", "d"], ["x", "x", "y", "y"], num_shards=2)
    assert sorted(res.loads) == sorted([2**61 + 5, 2**61 + 3])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weights=[1, 2], keys=["a"], groups=["g", "g"]), "equal lengths"),
        (dict(weights=[1, 2], keys=["a", "a"], groups=["g", "g"]), "unique"),
        (dict(weights=[-1], keys=["a"], groups=["g"]), "non-negative"),
    ],
)
def test_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lpt_partition(kwargs["weights"], kwargs["keys"], kwargs["groups"], num_shards=2)


def test_random_stress_bound_many_slots():
    rng = random.Random(0)
    keys = [f"layers.{i // 7}.m{i % 7}" for i in range(560)]
    weights = [rng.randint(1, 10**8) for _ in keys]
    groups = [k.rsplit(".", 1)[0] for k in keys]
    res = lpt_partition(weights, keys, groups, num_shards=64, num_replicas=16)
    assert res.max_load * 1024 <= sum(weights) + 1024 * max(weights)


# --------------------------------------------------------------------------- owner groups

from fractions import Fraction  # noqa: E402

from dmuon.plan._ownership.partition import lpt_partition_groups  # noqa: E402


def row_blocks(long_side: int, short_numel: int, k: int) -> tuple[int, ...]:
    """Weights of ``k`` balanced blocks along the long side: the first ``L % k`` one row longer."""
    q, r = divmod(long_side, k)
    return tuple((q + (j < r)) * short_numel for j in range(k))


def group_call(shapes, max_split, keys, groups, *, N, R, split="auto", slack=0.25, initial_loads=None):
    """lpt_partition_groups on items of (long side, short-side numel), numel weights."""
    weights = [L * s for L, s in shapes]

    def piece_weights(i, k):
        assert k >= 2  # k = 1 is never asked
        return row_blocks(*shapes[i], k)

    return lpt_partition_groups(
        weights,
        piece_weights,
        max_split,
        keys,
        groups,
        num_shards=N,
        num_replicas=R,
        split=split,
        slack=slack,
        initial_loads=initial_loads,
    )


@st.composite
def group_instances(draw, *, max_items: int = 24, max_slots: int = 4096):
    """(shapes, max_split, keys, groups, R, N): matrices as (long side, short numel), on 1..4096 slots."""
    R = draw(st.sampled_from([1, 2, 4, 8]))
    N = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64, 128, 512]).filter(lambda n: n * R <= max_slots))
    n_groups = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 5), min_size=n_groups, max_size=n_groups))
    keys, groups = _boundary_items(sizes, max_items)
    shapes = [(draw(st.integers(1, 3000)), draw(st.sampled_from([0, 1, 7, 64, 1000]))) for _ in keys]
    max_split = [draw(st.integers(1, max(1, min(N, L)))) for L, _ in shapes]
    return shapes, max_split, keys, groups, R, N


def check_structure(res, shapes, max_split, R, N, ks=None):
    """Members in one replicate row on distinct shard coordinates, len == k <= max_split, block
    j's weight on member j, loads == sum of the pieces, max_load within the stated bound."""
    loads = [0] * (R * N)
    for i, m in enumerate(res.members):
        k = len(m)
        assert 1 <= k <= max_split[i]
        if ks is not None:
            assert k == ks[i]
        assert len({s // N for s in m}) == 1
        assert len({s % N for s in m}) == k
        assert all(0 <= s < R * N for s in m)
        pieces = (shapes[i][0] * shapes[i][1],) if k == 1 else row_blocks(*shapes[i], k)
        for s, p in zip(m, pieces):
            loads[s] += p
    assert tuple(loads) == res.loads
    num, den = res.bound
    assert res.max_load * den <= num


def stated_bound(res, shapes, R, N) -> Fraction:
    """The bound of the docstring, recomputed: T/S + W (R = 1 or K = 1), N/(N-K+1) T/S + W."""
    pieces = [(L * s,) if len(m) == 1 else row_blocks(L, s, len(m)) for (L, s), m in zip(shapes, res.members)]
    T = sum(sum(p) for p in pieces)
    W = max(max(p) for p in pieces)
    K = max(len(m) for m in res.members)
    S = R * N
    return Fraction(T, S) + W if R == 1 or K == 1 else Fraction(T * N, S * (N - K + 1)) + W


GROUP_SETTINGS = settings(max_examples=60, deadline=None, database=None)


@GROUP_SETTINGS
@given(group_instances())
def test_groups_split_1_is_lpt_partition(inst):
    shapes, max_split, keys, groups, R, N = inst
    res = group_call(shapes, max_split, keys, groups, N=N, R=R, split=1)
    ref = lpt_partition([L * s for L, s in shapes], keys, groups, num_shards=N, num_replicas=R)
    assert res.members == tuple((s,) for s in ref.slots)
    assert res.loads == ref.loads and res.bound == ref.bound
    # every max_split == 1: "auto" cannot split either
    auto = group_call(shapes, [1] * len(keys), keys, groups, N=N, R=R)
    assert auto.members == res.members


@GROUP_SETTINGS
@given(group_instances(), st.integers(2, 16))
def test_groups_forced_split_structure_and_bound(inst, k):
    shapes, max_split, keys, groups, R, N = inst
    res = group_call(shapes, max_split, keys, groups, N=N, R=R, split=k)
    check_structure(res, shapes, max_split, R, N, ks=[min(k, m) for m in max_split])
    if any(L * s for L, s in shapes):
        assert Fraction(*res.bound) == stated_bound(res, shapes, R, N)


def test_groups_initial_loads_bound_when_a_group_spans_the_row():
    """A group of every shard slot must load the slot that starts highest, so with initial loads
    that differ by more than the largest piece the 1-D bound ``T/S + W`` does not hold (the case
    hypothesis found): N = 2, R = 1, initial (0, 3), one 2 x 1 matrix split 2 ways into blocks of 1.
    By hand: loads (1, 4); T = 2 + 3 = 5, W = 1, K = 2: ``N/(N-K+1) * T/S + W = 2 * 5/2 + 1 = 6``,
    as (12, 2); the old ``T/S + W = 3.5`` is below the makespan. Ten such matrices on initial
    (0, 100): every one puts a block on slot 1, loads (10, 110), bound (120·2 + 2) / 2 = 121."""
    res = group_call([(2, 1)], [2], ["m"], ["layers.0"], N=2, R=1, split=2, initial_loads=[0, 3])
    assert res.loads == (1, 4) and res.max_load == 4
    assert res.bound == (12, 2)
    keys = [f"layers.{i}.m" for i in range(10)]
    res = group_call(
        [(2, 1)] * 10, [2] * 10, keys, [f"layers.{i}" for i in range(10)], N=2, R=1, split=2, initial_loads=[0, 100]
    )
    assert res.loads == (10, 110) and res.bound == (242, 2)
    # initial loads within W of each other keep the 1-D bound: (0, 1), W = 1 -> (3 + 2·1) / 2
    res = group_call([(2, 1)], [2], ["m"], ["layers.0"], N=2, R=1, split=2, initial_loads=[0, 1])
    assert res.loads == (1, 2) and res.bound == (5, 2)


@GROUP_SETTINGS
@given(group_instances(max_slots=256), st.sampled_from(["auto", 1, 3]), st.data())
def test_groups_initial_loads(inst, split, data):
    """``initial_loads`` (expert-parallel ranges placed first): the structure as without them,
    ``loads`` = initial + pieces, ``max_load`` within the stated bound (pieces + initial as ``T``,
    at least the largest initial load; on one row with groups and initial loads more than the
    largest piece apart, the ``N/(N-K+1)`` form); all-zero initial loads give the plain result."""
    shapes, max_split, keys, groups, R, N = inst
    init = data.draw(st.lists(st.integers(0, 10**6), min_size=R * N, max_size=R * N))
    res = group_call(shapes, max_split, keys, groups, N=N, R=R, split=split, initial_loads=init)
    plain = group_call(shapes, max_split, keys, groups, N=N, R=R, split=split, initial_loads=[0] * (R * N))
    assert plain == group_call(shapes, max_split, keys, groups, N=N, R=R, split=split)
    loads = list(init)
    for i, m in enumerate(res.members):
        assert len({s // N for s in m}) == 1 and len({s % N for s in m}) == len(m) <= max_split[i]
        pieces = (shapes[i][0] * shapes[i][1],) if len(m) == 1 else row_blocks(*shapes[i], len(m))
        for s, p in zip(m, pieces):
            loads[s] += p
    assert tuple(loads) == res.loads
    num, den = res.bound
    assert res.max_load * den <= num
    if any(L * s for L, s in shapes):
        T = Fraction(sum(init)) + sum(
            sum((L * s,) if len(m) == 1 else row_blocks(L, s, len(m))) for (L, s), m in zip(shapes, res.members)
        )
        W = max(max((L * s,) if len(m) == 1 else row_blocks(L, s, len(m))) for (L, s), m in zip(shapes, res.members))
        if R == 1 and max(len(m) for m in res.members) > 1 and max(init) - min(init) > W:
            # one row, groups, initial loads further apart than a piece: the N/(N-K+1) form
            K = max(len(m) for m in res.members)
            b = Fraction(T * N, R * N * (N - K + 1)) + W
        else:
            b = stated_bound(res, shapes, R, N) + (T - stated_bound_total(res, shapes)) * _bound_factor(res, R, N) / (
                R * N
            )
        assert Fraction(num, den) == max(Fraction(max(init)), b)


def stated_bound_total(res, shapes) -> int:
    return sum(sum((L * s,) if len(m) == 1 else row_blocks(L, s, len(m))) for (L, s), m in zip(shapes, res.members))


def _bound_factor(res, R, N) -> Fraction:
    K = max(len(m) for m in res.members)
    return Fraction(1) if R == 1 or K == 1 else Fraction(N, N - K + 1)


@GROUP_SETTINGS
@given(group_instances(), st.sampled_from([0.0, 0.1, 0.25, 1.0]))
def test_groups_auto_structure_bound_and_target(inst, slack):
    shapes, max_split, keys, groups, R, N = inst
    res = group_call(shapes, max_split, keys, groups, N=N, R=R, slack=slack)
    check_structure(res, shapes, max_split, R, N)
    weights = [L * s for L, s in shapes]
    S = R * N
    limit = (1 + Fraction(slack)) * sum(weights)
    plain = lpt_partition(weights, keys, groups, num_shards=N, num_replicas=R)
    if plain.max_load * S <= limit:  # plain LPT meets the target: nothing is split
        assert res.members == tuple((s,) for s in plain.slots)
    # never worse than plain LPT when it splits (it only splits where plain misses the target)
    assert res.max_load <= plain.max_load or res.max_load * S <= limit
    # guaranteed to meet the target when every item can get blocks <= slack * T/S (R = 1;
    # R > 1 with the N/(N-K+1) factor, K = the largest k that needs)
    cap = Fraction(slack) * sum(weights) / S
    need = []
    for (L, s), m in zip(shapes, max_split):
        k = next((k for k in range(1, m + 1) if -(-L // k) * s <= cap), None)  # largest block
        need.append(k)
    if sum(weights) and all(k is not None for k in need):
        K = max(need)
        factor = 1 if R == 1 or K == 1 else Fraction(N, N - K + 1)
        if factor * sum(weights) / S + cap <= limit / S:
            assert res.max_load * S <= limit


@st.composite
def fine_instances(draw):
    """Items that can be cut fine (long sides of hundreds to thousands of rows, max_split = N)
    and enough of them per slot that the "auto" guarantee's premise holds often."""
    R = draw(st.sampled_from([1, 2, 4]))
    N = draw(st.sampled_from([4, 8, 16, 64]) if R == 1 else st.sampled_from([32, 64]))
    n = draw(st.integers(4, 24) if R == 1 else st.integers(16 * R, 32 * R))
    shapes = [(draw(st.integers(1000, 3000)), draw(st.sampled_from([1, 3]))) for _ in range(n)]
    keys = [f"layers.{i // 4}.p{i % 4}" for i in range(n)]
    groups = [f"layers.{i // 4}" for i in range(n)]
    return shapes, [N] * n, keys, groups, R, N


def fallback_cut_meets(shapes, R, N, slack) -> bool:
    """The docstring's premise: some cap c = slack * T/S / 2**j (j < 8, while c > 1) cuts every
    item to the smallest k <= N with blocks <= c (N where none is) and the proven bound of that
    cut is <= (1 + slack) * T/S."""
    total = sum(L * s for L, s in shapes)
    S = R * N
    cap = Fraction(slack) * total / S
    for _ in range(8):
        ks = [1 if L * s <= cap else next((k for k in range(2, N + 1) if -(-L // k) * s <= cap), N) for L, s in shapes]
        pieces = [row_blocks(L, s, k) for (L, s), k in zip(shapes, ks)]
        T, W, K = sum(map(sum, pieces)), max(map(max, pieces)), max(ks)
        bound = Fraction(T, S) + W if R == 1 or K == 1 else Fraction(T * N, S * (N - K + 1)) + W
        if bound * S <= (1 + Fraction(slack)) * total:
            return True
        if cap <= 1:
            return False
        cap /= 2
    return False


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(fine_instances(), st.sampled_from([0.25, 0.5, 1.0, 2.0]))
def test_groups_auto_meets_target_when_the_bound_allows(inst, slack):
    """Docstring guarantee: when a cut's proven bound meets the target, "auto" meets
    max <= (1 + slack) * T/S (the level scan finds a placement, or the fallback places that cut)."""
    shapes, max_split, keys, groups, R, N = inst
    assume(fallback_cut_meets(shapes, R, N, slack))
    res = group_call(shapes, max_split, keys, groups, N=N, R=R, slack=slack)
    check_structure(res, shapes, max_split, R, N)
    assert res.max_load * R * N <= (1 + Fraction(slack)) * sum(L * s for L, s in shapes)


@GROUP_SETTINGS
@given(group_instances(max_items=16), st.randoms(use_true_random=False), st.sampled_from(["auto", 3]))
def test_groups_deterministic_and_input_order_independent(inst, rnd, split):
    shapes, max_split, keys, groups, R, N = inst
    res = group_call(shapes, max_split, keys, groups, N=N, R=R, split=split)
    assert res == group_call(shapes, max_split, keys, groups, N=N, R=R, split=split)
    perm = list(range(len(keys)))
    rnd.shuffle(perm)
    shuffled = group_call(
        [shapes[i] for i in perm],
        [max_split[i] for i in perm],
        [keys[i] for i in perm],
        [groups[i] for i in perm],
        N=N,
        R=R,
        split=split,
    )
    assert {keys[i]: m for i, m in zip(perm, shuffled.members)} == dict(zip(keys, res.members))
    assert shuffled.loads == res.loads and shuffled.bound == res.bound


def test_groups_hand_example_block_order():
    """N = 3: p(10) -> slot 0; q(5) -> slot 1; b = 7 split 2 into blocks (4, 3): the two
    least-loaded slots are 2 (0) and 1 (5); block 0 (the larger) goes to slot 2, block 1 to 1."""
    res = lpt_partition_groups(
        [10, 5, 7],
        lambda i, k: row_blocks(7, 1, k),
        [1, 1, 2],
        ["p", "q", "b"],
        ["g"] * 3,
        num_shards=3,
        split=2,
    )
    assert res.members == ((0,), (1,), (2, 1))
    assert res.loads == (10, 8, 4)
    assert res.bound == (10 + 5 + 7 + 3 * 10, 3)  # T/S + W, W = 10 (the unsplittable p)


def test_groups_row_constraint_costs_in_the_bound():
    """Docstring example: R = 4, N = 3, four items of 28 and one of 26, all k = 2. Every row is
    (14, 14, 0) before the 26; its blocks (13, 13) need two slots of one row: peak 27 >
    T/S + W = 11.5 + 14, within N/(N-K+1) T/S + W = 1.5 * 11.5 + 14."""
    res = lpt_partition_groups(
        [28, 28, 28, 28, 26],
        lambda i, k: row_blocks([28, 28, 28, 28, 26][i], 1, k),
        [2] * 5,
        list("abcde"),
        ["g"] * 5,
        num_shards=3,
        num_replicas=4,
        split=2,
    )
    assert res.members[:4] == ((0, 1), (3, 4), (6, 7), (9, 10))
    assert res.members[4] == (2, 0) and res.max_load == 27
    assert res.max_load > Fraction(138, 12) + 14
    assert Fraction(*res.bound) == Fraction(3, 2) * Fraction(138, 12) + 14


def llama_items(layers: int, hidden: int, kv_dim: int, inter: int):
    """The dedicated matrices of a Llama-3 shape (as dmuon._zoo builds them) as
    (long side, short side) per FQN, in named_parameters() order."""
    shapes, keys, groups = [], [], []
    for layer in range(layers):
        for name, (m, n) in (
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (kv_dim, hidden)),
            ("self_attn.v_proj", (kv_dim, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (inter, hidden)),
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            shapes.append((max(m, n), min(m, n)))
            keys.append(f"model.layers.{layer}.{name}.weight")
            groups.append(f"model.layers.{layer}")
    return shapes, keys, groups


LLAMA3_405B = dict(layers=126, hidden=16384, kv_dim=1024, inter=53248)
LLAMA3_70B = dict(layers=80, hidden=8192, kv_dim=1024, inter=28672)


@pytest.mark.parametrize(
    "model, R, N, plain_empty, max_ratio",
    [
        (LLAMA3_405B, 1, 1024, 142, 1.12),
        (LLAMA3_405B, 1, 4096, 3214, 1.12),
        (LLAMA3_70B, 8, 128, 464, 1.18),
        (LLAMA3_70B, 1, 1024, 464, 1.18),
    ],
)
def test_groups_llama_auto_balances_past_one_matrix_per_rank(model, R, N, plain_empty, max_ratio):
    """The issue's cases: exclusive owners leave ranks with nothing (142 of 1024 for 405B, 464
    for 70B on 8 x 128, as the issue reports from today's plans) and max/mean 2.2-8.9; "auto"
    leaves no rank empty and max/mean under 1.25."""
    shapes, keys, groups = llama_items(**model)
    max_split = [min(N, L) for L, _ in shapes]
    S = R * N
    total = sum(L * s for L, s in shapes)
    plain = group_call(shapes, max_split, keys, groups, N=N, R=R, split=1)
    assert plain.num_empty_slots == plain_empty and plain.max_load * S > 2 * total
    res = group_call(shapes, max_split, keys, groups, N=N, R=R)
    check_structure(res, shapes, max_split, R, N)
    assert res.num_empty_slots == 0
    assert res.max_load * S <= max_ratio * total


def test_groups_more_splitting_can_be_worse():
    """Docstring: 405B on 1024 slots meets the target with the MLP matrices at k = 2 (max/mean
    1.11), not at k = 3 (1134 blocks on 1024 slots: some slot holds two, 1.48)."""
    shapes, keys, groups = llama_items(**LLAMA3_405B)
    big = [L * s == 53248 * 16384 for L, s in shapes]
    total = sum(L * s for L, s in shapes)
    for k, lo, hi in ((2, 1.10, 1.12), (3, 1.47, 1.49)):
        res = group_call(shapes, [k if b else 1 for b in big], keys, groups, N=1024, R=1, split=k)
        assert lo * total <= res.max_load * 1024 <= hi * total
    auto = group_call(shapes, [1024] * len(keys), keys, groups, N=1024, R=1)
    assert {len(m) for m, b in zip(auto.members, big) if b} == {2}
    assert {len(m) for m, b in zip(auto.members, big) if not b} == {1}


def test_groups_unsplittable_item_raises_the_target():
    """An item that may not split (max_split = 1, e.g. TP-sharded) above the target sets the
    target: nothing else is split on its account."""
    shapes = [(1000, 100), (10, 10), (10, 10), (10, 10)]
    res = group_call(shapes, [1, 4, 4, 4], ["a", "b", "c", "d"], ["x"] * 4, N=4, R=1)
    assert res.group_sizes == (1, 1, 1, 1)
    assert res.max_load == 100_000


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_split=[0, 1]), r"max_split\[0\]"),
        (dict(max_split=[1, 3]), r"max_split\[1\]"),
        (dict(max_split=[1]), "one entry per item"),
        (dict(split=0), "split must be"),
        (dict(split="yes"), "split must be"),
        (dict(slack=-0.1), "slack"),
        (dict(piece_weights=lambda i, k: (1,) * (k + 1), split=2), r"piece_weights\(\d, 2\)"),
        (dict(piece_weights=lambda i, k: (-1,) * k, split=2), "non-negative"),
    ],
)
def test_groups_bad_inputs(kwargs, match):
    args = dict(
        weights=[4, 6],
        piece_weights=lambda i, k: row_blocks(2, [2, 3][i], k),
        max_split=[2, 2],
        keys=["a", "b"],
        groups=["g", "g"],
        num_shards=2,
    )
    args.update(kwargs)
    weights, pw, ms, keys, groups = (args.pop(n) for n in ("weights", "piece_weights", "max_split", "keys", "groups"))
    with pytest.raises(ValueError, match=match):
        lpt_partition_groups(weights, pw, ms, keys, groups, **args)


def test_groups_large_weights_use_exact_integers():
    w = [2**61, 2**61, 3, 5]

    def piece_weights(i, k):
        return tuple(w[i] // k + (j < w[i] % k) for j in range(k))

    for split in (2, "auto"):
        res = lpt_partition_groups(
            w, piece_weights, [4, 4, 1, 1], list("abcd"), ["x", "x", "y", "y"], num_shards=4, split=split
        )
        assert res.members == ((0, 1), (2, 3), (1,), (0,))
        assert res.loads == (2**60 + 5, 2**60 + 3, 2**60, 2**60)


def test_groups_zero_weights_keep_distinct_members():
    """Zero-weight items leave loads unchanged; a group must still get k distinct slots
    (b takes slot 1 by the spread preference: a used coordinate 0 of boundary g)."""
    res = lpt_partition_groups(
        [0, 0, 0, 0], lambda i, k: (0,) * k, [1, 1, 2, 2], list("abcd"), ["g"] * 4, num_shards=2, split=2
    )
    assert res.members == ((0,), (1,), (0, 1), (0, 1))
    assert res.loads == (0, 0)
