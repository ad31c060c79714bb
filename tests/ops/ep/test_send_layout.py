"""The sender-side layout kernels (`build_send_layout`) against a plain Python walk of the routing."""
from __future__ import annotations

import pytest
import torch

from ditron_ep.ops.ep import layout_replay
from ditron_ep.ops.ep.layout_kernels import FLAG_BAD_EXPERT, FLAG_TOO_MANY_TOKENS, build_send_layout


def reference_layout(idx: torch.Tensor, E: int, W: int, max_tokens: int) -> dict:
    """Pairs in (t, k) order, tokens in t order: every position counts the earlier ones."""
    T, K = idx.shape
    e_local = E // W
    topk = idx.clone().long()
    pos = torch.zeros(T, K, dtype=torch.long)
    slot = torch.full((T, W), -1, dtype=torch.long)
    counts, tokens_to, send = [0] * E, [0] * W, {}
    for t in range(T):
        ranks = set()
        for k in range(K):
            e = int(idx[t, k])
            if 0 <= e < E and t < max_tokens:
                pos[t, k] = counts[e]
                counts[e] += 1
                ranks.add(e // e_local)
            else:
                topk[t, k] = -1
        for d in sorted(ranks):
            slot[t, d] = tokens_to[d]
            send[(d, tokens_to[d])] = t
            tokens_to[d] += 1
    flags = (FLAG_BAD_EXPERT if bool(((idx < -1) | (idx >= E)).any()) else 0) | \
        (FLAG_TOO_MANY_TOKENS if T > max_tokens else 0)
    return {"topk": topk, "pos": pos, "slot": slot, "counts": counts, "tokens_to": tokens_to, "send": send,
            "flags": flags}


CASES = [  # T, K, E, W, max_tokens, dtype
    (37, 3, 12, 3, 40, torch.int64),    # T not a multiple of the block, K not a power of two
    (50, 8, 256, 4, 64, torch.int32),   # E = 256, top-8
    (0, 2, 8, 2, 4, torch.int32),       # no tokens
    (20, 1, 4, 2, 8, torch.int64),      # top-1, more tokens than max_tokens: the tail is dropped
    (33, 5, 10, 5, 40, torch.int32),    # world size 5
]


@pytest.mark.parametrize("one_program", [True, False], ids=["one_program", "three_launches"])
@pytest.mark.parametrize("T,K,E,W,max_tokens,dtype", CASES)
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_send_layout_matches_reference(T, K, E, W, max_tokens, dtype, routing, one_program) -> None:
    g = torch.Generator().manual_seed(T * 131 + K * 7 + E)
    if routing == "random":
        idx = torch.randint(-1, E, (T, K), generator=g, dtype=dtype)
    else:  # every pair to expert E - 1 (only top-1 is a valid distinct routing, but ids may repeat here)
        idx = torch.full((T, K), E - 1, dtype=dtype)
    if T > 4:
        idx[2, 0] = E + 5            # out of range: dropped and flagged
        idx[3, -1] = -7              # below -1: dropped and flagged
        if dtype == torch.int64:
            idx[4, 0] = 2**40 + 1    # would wrap into range if narrowed to int32 before the check
    ref = reference_layout(idx, E, W, max_tokens)
    got = build_send_layout(idx, E, W, max_tokens, one_program=one_program)
    assert torch.equal(got.topk_idx.long(), ref["topk"])
    routed = ref["topk"] >= 0
    assert torch.equal(got.pos.long()[routed], ref["pos"][routed])
    assert torch.equal(got.slot.long(), ref["slot"])
    assert got.counts.tolist() == ref["counts"]
    assert got.tokens_to.tolist() == ref["tokens_to"]
    assert {(d, j): int(got.send_idx[d, j]) for (d, j) in ref["send"]} == ref["send"]
    assert int(got.flags) == ref["flags"]


@pytest.mark.parametrize("T", [0, 1, 16, 17, 100, 256, 300])
def test_one_program_layout_writes_the_same_words(T) -> None:
    """The one-program path (small T by default) and the three launches write the same words of
    every output, the prefix rows included (both into arenas poisoned alike)."""
    from ditron_ep.ops.ep.layout_replay import Int32Arena, layout_arena_words

    K, E, W, max_tokens = 8, 64, 4, 280
    g = torch.Generator().manual_seed(T + 5)
    idx = torch.randint(-1, E, (T, K), generator=g, dtype=torch.int64)
    if T > 20:
        idx[3, 2], idx[7, 0] = E + 1, -3  # flagged
        idx[10:20] = E - 1                # a burst to one expert
    arenas = []
    for one in (True, False):
        arena = Int32Arena(layout_arena_words(T, K, E, W, max_tokens), torch.device("cpu"))
        arena.flat.fill_(-777)
        build_send_layout(idx, E, W, max_tokens, alloc=arena, one_program=one)
        arenas.append(arena.flat)
    assert torch.equal(arenas[0], arenas[1])


def test_send_layout_rejects_a_bad_index_tensor() -> None:
    with pytest.raises(ValueError, match="int32/int64"):
        build_send_layout(torch.zeros(4, 2), 8, 2, 8)


@pytest.mark.parametrize("T,K,E,W,max_tokens,dtype", CASES)
def test_send_layout_in_an_arena_and_its_rebased_copy(T, K, E, W, max_tokens, dtype) -> None:
    """With an Int32Arena as allocator (ops/ep/layout_replay.py) the layout is the same; every tensor
    is a view of the arena, 64-byte aligned; its rebased copy onto a clone of the arena keeps the
    values after the arena is overwritten (what a handle needs past the next graph replay)."""
    from ditron_ep.ops.ep.layout_replay import Int32Arena, layout_arena_words, rebuild_layout, view_recipe

    g = torch.Generator().manual_seed(T + 11 * E)
    idx = torch.randint(-1, E, (T, K), generator=g, dtype=dtype)
    want = build_send_layout(idx, E, W, max_tokens)
    arena = Int32Arena(layout_arena_words(T, K, E, W, max_tokens), torch.device("cpu"))
    arena.flat.fill_(-777)
    got = build_send_layout(idx, E, W, max_tokens, alloc=arena)
    fields = ("topk_idx", "pos", "slot", "counts", "tokens_to", "flags")
    for f in fields:
        t = getattr(got, f)
        assert t.untyped_storage().data_ptr() == arena.flat.untyped_storage().data_ptr(), f
        assert t.data_ptr() % 64 == 0 or f in ("counts", "tokens_to"), f  # those two: views into prefix
        assert torch.equal(t, getattr(want, f)), f
    snap = arena.flat[:arena.used].clone()
    moved = rebuild_layout(view_recipe(got, arena.flat), snap)
    arena.flat.fill_(-1)
    for f in fields:
        assert torch.equal(getattr(moved, f), getattr(want, f)), f
    assert moved.send_idx.untyped_storage().data_ptr() == snap.untyped_storage().data_ptr()


def test_arena_refuses_more_than_it_was_sized_for() -> None:
    from ditron_ep.ops.ep.layout_replay import Int32Arena

    arena = Int32Arena(40, torch.device("cpu"))
    assert arena((2, 3)).shape == (2, 3) and arena.used == 16  # every view starts 64-byte aligned
    arena((24,))
    with pytest.raises(ValueError, match="cannot hold"):
        arena((1,))


@pytest.mark.skipif(layout_replay._storage_use_count is None,
                    reason="this torch cannot count a storage's references: copies are never lent")
def test_a_captured_layout_is_idle_only_while_nothing_else_holds_it() -> None:
    """CapturedLayout.idle (which decides whether a replay may hand a copy's own layout to a call):
    a reference kept to its layout objects, to any of their tensors, to recv_rows or to a whole
    call's outputs, or a view taken of any of their memory, makes it busy; dropping it makes it
    idle again."""
    from dataclasses import dataclass

    from ditron_ep.ops.ep.layout_replay import CapturedLayout, Int32Arena

    @dataclass
    class Layout:
        a: torch.Tensor
        b: torch.Tensor
        n: int = 3

    arena = Int32Arena(64, torch.device("cpu"))
    c = CapturedLayout(topk_idx=torch.empty(4, 2, dtype=torch.int32), graph=None, arena=arena,
                       status=torch.empty(4, dtype=torch.int32), ready=None,
                       recv_rows=torch.empty(2, 4, 2, dtype=torch.int32), recv_tok=torch.empty(2, 4, dtype=torch.int32))
    c.send, c.recv = Layout(arena((4,)), arena((2, 2))), Layout(arena((8,)), arena((3,)))
    c.outputs = {"recv_x": torch.empty(6, 4), "recv_w": None}
    assert c.idle()  # never lent: nothing to watch yet
    c.arm()
    assert c.idle()
    for take in (lambda: c.send, lambda: c.recv.b, lambda: c.recv_rows, lambda: c.recv_tok[1],
                 lambda: c.arena.flat[5:9], lambda: c.send.a.view(2, 2), lambda: c.outputs["recv_x"][:3]):
        held = take()
        assert not c.idle()
        del held
        assert c.idle()


@pytest.mark.skipif(layout_replay._storage_use_count is None,
                    reason="this torch cannot count a storage's references: copies are never lent")
def test_whole_call_copies_are_lent_one_call_at_a_time_and_never_shared() -> None:
    """LayoutReplays(shared=False), as EPBuffer._whole_call uses it (the CUDA graph and its event
    stood in for by a stub counting replays): a call gets an idle copy with its inputs copied into
    the copy's static ones (routing rows past a smaller call's T set to -1); while calls hold their
    copies up to 3 are captured, then a call gets None (it launches as usual) rather than a shared
    copy; a copy its holder dropped serves the next call."""
    from dataclasses import dataclass

    from ditron_ep.ops.ep.layout_replay import CapturedLayout, Int32Arena, LayoutReplays

    class Stub:
        def __init__(self):
            self.replays = 0

        def replay(self):
            self.replays += 1

        def record(self, stream):
            assert stream is None  # CPU tensors: no stream

    @dataclass
    class Send:
        topk_idx: torch.Tensor
        pos: torch.Tensor
        slot: torch.Tensor

    @dataclass
    class Recv:
        counts: torch.Tensor

    rows, H = 8, 4

    def capture(lent: bool) -> CapturedLayout:
        assert lent
        arena = Int32Arena(64, torch.device("cpu"))
        c = CapturedLayout(topk_idx=torch.zeros(rows, 2, dtype=torch.int64), graph=Stub(), arena=arena,
                           status=torch.zeros(4, dtype=torch.int32), ready=Stub(),
                           recv_rows=torch.empty(1, rows, 2, dtype=torch.int32),
                           recv_tok=torch.empty(1, rows, dtype=torch.int32))
        c.send = Send(arena((rows, 2)), arena((rows, 2)), arena((rows, 2)))
        c.recv = Recv(arena((4,)))
        c.inputs = (torch.zeros(rows, H),)
        c.outputs = {"recv_x": torch.empty(rows, H), "row_index": None}
        return c

    replays = LayoutReplays(capture, shared=False)
    held = []
    for i in range(3):  # each call keeps its rows: a new copy each time
        T = rows - 2 * i
        idx, x = torch.full((T, 2), i, dtype=torch.int64), torch.full((T, H), float(i))
        r = replays.replay(idx, (x,))
        assert r is not None and r[3] and r[2] is replays.copies[i] and r[2].graph.replays == 1
        assert r[0].topk_idx.shape[0] == T  # the call's own rows of the send layout
        assert torch.equal(r[2].inputs[0][:T], x) and torch.equal(r[2].topk_idx[:T], idx)
        assert (r[2].topk_idx[T:] == -1).all()
        held.append(r[2].outputs["recv_x"][:T])
        del r
    assert replays.replay(torch.zeros(rows, 2, dtype=torch.int64), (torch.zeros(rows, H),)) is None
    assert len(replays.copies) == 3 and replays.shared is None
    del held[1]  # the second call's rows dropped: its copy serves the next call, with a smaller T
    idx, x = torch.full((3, 2), 7, dtype=torch.int64), torch.full((3, H), 7.0)
    r = replays.replay(idx, (x,))
    assert r is not None and r[2] is replays.copies[1] and r[2].graph.replays == 2
    assert torch.equal(r[2].topk_idx[:3], idx) and (r[2].topk_idx[3:] == -1).all()
    assert torch.equal(r[2].inputs[0][:3], x)
