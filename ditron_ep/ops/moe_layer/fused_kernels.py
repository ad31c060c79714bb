"""The fused EP MoE megakernel: dispatch -> grouped expert GEMM (activation fused) -> down GEMM -> combine in one
persistent launch, synchronised at tile granularity (the layout stage is a separate launch).

Programs take tasks from an ordered queue of atomic tickets. Stages, in queue order:
  S0 dispatch_send   (dest d, chunk c): stage the chunk's tokens on d, stamp flag (me, c) on d
  S1 dispatch_recv   (source s, chunk c): wait that flag; for every (token, k) of the chunk
                     routed here write the GEMM row's gather index (no data copy) and count the
                     row into its GEMM row tile (local counter). S0 and S1 share the first
                     tickets, interleaved (plan field recv_lag; task_queue.py).
  S2 gemm_gate_up    (row tile i, col tile j): wait until all rows of tile i are placed; the
                     expert's activation (experts.py: SwiGLU by default) and bias.
                     Row tiles come in arrival order (the layout launch sorts them: tiles of
                     this rank's own rows first, then by the ring position of their last source),
                     walked in the plan's groups of gemm_group tiles (plan.GEMM_TILE_ORDERS)
  S3 gemm_down       (row tile i, col tile j): wait for all gate-up tiles of row tile i; down
                     GEMM; the tile's rows go straight to their token's rank, landing at
                     [token, k] (+1 on that (token, k)'s counter there). The +1s are published
                     one down tile later (or before the program's next wait): the system-scope
                     release waits until the rows have crossed NVLink, and by then they have
                     had a whole tile of compute to do so. Publishing at once left every SM
                     idle ~20 us per tile: the down stage took 2.68 ms instead of 2.01 ms at
                     T=4096 on 4xH200 (bench/results/moe_timeline_H200x4_20261122.log).
  S4 combine_reduce  (token block): wait until every routed (token, k) has all its column
                     tiles; out[t] = sum_k w[t, k] * y(t, k) in fp32, k in order; cast once.
                     A call with fewer tokens than the plan's max spreads its blocks over the
                     stage's tasks as column slices (plan.combine_task_split)
The plan sizes S2/S3 for the most row tiles any routing can make; tickets are handed out only
for the row tiles this call's routing fills (tile_start[E_local], read on the device), in the
plan's order, so tasks of empty row tiles are skipped rather than run as no-ops. Likewise S0/S1
take tickets only for the chunks below the call's largest T over all ranks (every rank's T comes
with the layout exchange), so a layer sized for prefill does not walk its empty chunks at decode.
Role split (plan field comm_programs > 0): the first comm_programs programs to start take the
S0/S1 tickets from their own counter, the others take S2.. from a second one; a comm program
whose queue is drained joins the compute queue. Progress: every wait is on a task of this rank
with a smaller ticket, or on another rank's task of an earlier stage (on every rank all tickets
of a stage come before those of the next; ticket numbers of one stage differ between ranks, as
the GEMM stages hold only the row tiles with rows), and the S0/S1 queue never waits on compute
tasks, so a GPU with every program resident never deadlocks; the interpreter, which runs one
program's whole queue in order, never waits on work not yet done.
Every position is a pure function of the routing and no tile is split along K, so the result
does not depend on which program runs what, on the grid size, on the task order within a
stage, or on `schedule="sequential"` (stage barriers from the plan): bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer as _cuda_globaltimer
from triton.language.extra.hip import memrealtime as _hip_memrealtime

from ditron_ep.language.nvshmem import SIGNAL_ADD, put_signal_word, putmem_signal_nbi_block, quiet, signal_after_puts
from ditron_ep.language.primitives import (
    call_begin,
    call_end,
    ctrl_ptr,
    heap_ptr,
    next_task_split,
    notify,
    notify_add,
    take_role,
    wait,
    wait_all,
)
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.language.task_queue import interleaved_task
from ditron_ep.ops.ep.combine_kernels import reduce_landed
from ditron_ep.ops.ep.dispatch_kernels import put_token_chunk, stage_token_chunk
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import down_acc, grouped_tile, up_tile
from ditron_ep.runtime.heap import register_stage

STAGE_MOE_RECV = tl.constexpr(register_stage(10, "moe: dispatch_recv waits for a chunk"))
STAGE_MOE_ROWS = tl.constexpr(register_stage(11, "moe: gemm_gate_up waits for its rows"))
STAGE_MOE_GATE_UP = tl.constexpr(register_stage(12, "moe: gemm_down waits for gate-up tiles"))
STAGE_MOE_LAND = tl.constexpr(register_stage(13, "moe: combine_reduce waits for expert outputs"))
STAGE_MOE_BARRIER = tl.constexpr(register_stage(14, "moe: sequential stage barrier"))


@register_device_function
@triton.jit
def _gemm_tile(q, n_cols, group, p_tiles):
    """q-th task of a GEMM stage (the plan's numbering: groups of `group` row-tile positions, the
    last one padded, StagePlan.coords) -> (row tile's natural index, column tile, expert,
    first row, rows). Positions index the layout's arrival-ordered tile table at p_tiles."""
    i_m, i_n = grouped_tile(q, (q // (group * n_cols) + 1) * group, n_cols, group)  # a whole group
    p_tile = p_tiles + i_m * 4
    # the table lists tiles in arrival order; a tile's signal words go by its natural index
    return tl.load(p_tile + 3), i_n, tl.load(p_tile), tl.load(p_tile + 1), tl.load(p_tile + 2)


@register_device_function
@triton.jit
def _gemm_task_of_ticket(t, F2, F3, F4, G3, G4, n_pos, n_t1, n_t2, group):
    """Ticket t >= F2 -> the plan's task id. Gate-up tickets [F2, G3) and down tickets [G3, G4)
    walk the first n_pos row-tile positions of the tile table in the plan's groups of `group`
    positions (the last live group may be shorter than the plan's), combine tickets follow.
    Live tasks keep their order in the plan's queue; only tasks of row tiles without rows (past
    n_pos) are never ticketed. Tickets below F2 pass through."""
    in_gu = (t >= F2) & (t < G3)
    in_dn = (t >= G3) & (t < G4)
    q = tl.where(in_gu, t - F2, tl.where(in_dn, t - G3, 0))  # 0 elsewhere: no division by a 0-row group
    n_cols = tl.where(in_gu, n_t1, n_t2)
    i_m, i_n = grouped_tile(q, n_pos, n_cols, group)
    q_plan = (i_m // group) * (group * n_cols) + i_n * group + i_m % group  # the plan's whole groups
    return tl.where(in_gu, F2 + q_plan, tl.where(in_dn, F3 + q_plan, tl.where(t >= G4, F4 + t - G4, t)))


# DEVICE_TIMER values: which clock a traced launch stamps (none under the interpreter).
TIMER_NONE, TIMER_CUDA, TIMER_HIP = 0, 1, 2


@register_device_function
@triton.jit
def _stamp_timer(p, DEVICE_TIMER: tl.constexpr):
    """Store the device's global nanosecond timer at p (a constexpr picks the vendor's clock)."""
    if DEVICE_TIMER == 1:
        tl.store(p, _cuda_globaltimer())
    elif DEVICE_TIMER == 2:
        tl.store(p, _hip_memrealtime().to(tl.int64))


@register_device_function
@triton.jit
def _publish_landed(cnt_addr, m):
    """+1 (release, system scope) on the landing counters at int64 addresses cnt_addr where m:
    every row this program stored before is visible on its rank first."""
    tl.debug_barrier()
    tl.atomic_add(cnt_addr.to(tl.pointer_type(tl.int32)), 1, mask=m, sem="release", scope="sys")


@register_device_function
@triton.jit
def _stage_barrier(sig_table_ptr, rank, world, my_ctrl, done_word, n_prev, cross_first, call_no, budget,
                   CROSS: tl.constexpr):
    """Sequential schedule: wait until every task of the previous stage is done on this rank
    (local counter) and, for CROSS barriers, on every rank (flags stamped with the call number by each rank)."""
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    ok = wait(p_sig + done_word, n_prev, my_ctrl, rank, STAGE_MOE_BARRIER, done_word, budget)
    if CROSS:
        for p in range(world):
            ok = ok & wait(p_sig + cross_first + p, call_no, my_ctrl, rank, STAGE_MOE_BARRIER, cross_first + p,
                           budget)
    return ok


@register_device_function
@triton.jit
def _stage_done(sig_table_ptr, rank, world, done_word, n_this, cross_first, call_no, STAMP: tl.constexpr):
    """Sequential schedule: count this task done; the task completing the stage stamps the
    cross-rank barrier flag of this rank on every rank (STAMP)."""
    tl.debug_barrier()
    done = tl.atomic_add(heap_ptr(sig_table_ptr, rank, 0, tl.int32) + done_word, 1, sem="acq_rel", scope="gpu")
    if STAMP:
        if done == n_this - 1:
            for p in range(world):
                notify(heap_ptr(sig_table_ptr, p, 0, tl.int32) + cross_first + rank, call_no)


@register_device_function
@triton.jit
def _put_down_rows(acc, put_m, o_n, table_ptr, sig_table_ptr, p_sig, p_rows_all, rank, i_m, row0, n_rows, H,
                   K: tl.constexpr, n_t2, land_off, send_land_off, sig_land, sig_put_tiles, put_peers, DT: tl.constexpr,
                   BM: tl.constexpr):
    """The put transport's down-tile output: the rows put_m of this [BM, BN2] tile (columns o_n) go
    into this rank's send area at their GEMM rows; the program finishing a row tile's last column
    tile (a local counter) puts each of its put rows whole (H columns, one block-scoped put) to
    land[token, k] on the token's rank with a SIGNAL_ADD of n_t2 on that (token, k)'s counter,
    delivered after the row — what the n_t2 column tiles' +1s say in the pointer path, so the
    combine stage waits alike. The same bytes land as with pointer stores."""
    ELT: tl.constexpr = DT.primitive_bitwidth // 8
    p_send = heap_ptr(table_ptr, rank, send_land_off, DT)
    o_m = tl.arange(0, BM)
    tl.store(p_send + (row0 + o_m).to(tl.int64)[:, None] * H + o_n[None, :], acc.to(DT),
             mask=put_m[:, None] & (o_n < H)[None, :])
    tl.debug_barrier()
    done = tl.atomic_add(p_sig + sig_put_tiles + i_m, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if done == n_t2 - 1:  # every column tile of these rows is in the send area
        own = tl.load(table_ptr + rank)  # symmetric addresses: this rank's base + offset
        for j in range(0, n_rows):
            p_r = p_rows_all + (row0 + j).to(tl.int64) * 4
            i_src = tl.load(p_r + 1)
            if ((put_peers >> i_src) & 1) != 0:
                i_tk = tl.load(p_r + 2).to(tl.int64) * K + tl.load(p_r + 3)
                sig, add = put_signal_word(sig_table_ptr, rank, sig_land + i_tk * 2, n_t2)
                putmem_signal_nbi_block(own + land_off + i_tk * H * ELT,
                                        own + send_land_off + tl.cast(row0 + j, tl.int64) * H * ELT,
                                        tl.cast(H, tl.int64) * ELT, sig, add, SIGNAL_ADD, i_src)
        tl.store(p_sig + sig_put_tiles + i_m, 0)  # for the next call (no other program adds to it now)


# refuse_flagged is 1 in default mode and 0 in graph mode: specialised (Triton makes an argument
# equal to 1 a constant), switching modes compiled the whole megakernel again (~7 s on an H200).
# gemm_group (1 for row_major) likewise: every tile order runs one binary. T likewise (it only
# bounds masks): calls of 1, 16·n and other token counts, and a refused call's 0, share a binary.
# rank likewise, as in every kernel that meets its peers (dispatch, combine, layout exchange, the TP
# and exchange kernels): rank 0 (a multiple of 16) and rank 1 (== 1) compiled binaries of their
# own, so ranks on one host could not share the Triton cache, and a rank compiling a variant its
# peers did not need kept them waiting at the call barrier (a put-transport GPU test timed out so
# on 2xH200: 49 compiles on one rank, 46 on the other, ~7-10 s each).
@triton.jit(do_not_specialize=["refuse_flagged", "gemm_group", "T", "rank", "put_peers"])
def moe_fused_kernel(
    x_ptr,            # (T, H) tokens of this rank
    topk_ptr,         # int32 (T, K) expert ids, -1 = dropped
    pos_ptr,          # int32 (T, K) position of (t, k) among this rank's pairs of its expert
    w_ptr,            # fp32 (T, K) routing weights
    send_idx_ptr,     # int32 (W, MAXT) j-th token sent to rank d
    tokens_to_ptr,    # int32 (W,)
    expert_off_ptr,   # int32 (E_local + 1,) first GEMM row of each local expert
    src_off_ptr,      # int32 (W, E_local)
    tokens_from_ptr,  # int32 (W,)
    tile_start_ptr,   # int32 (E_local + 1,) first row tile of each local expert
    w1_ptr,           # (E_local, H, n*I): gate ‖ up (gated activations) or z's weights; any strides
    w2_ptr,           # (E_local, I, H); any strides
    b1_ptr,           # (E_local, n*I) (read when HAS_B1)
    b2_ptr,           # (E_local, H) (read when HAS_B2)
    out_ptr,          # out (T, H)
    trace_ptr,        # out int32 (NT, 2): logical start / end clock of every ticket (TRACE)
    timer_ptr,        # out int64 (NT + 1, 2): device timer at start / end of every ticket (DEVICE_TIMER)
    clock_ptr,        # int32 (1,) logical clock, zero at launch
    src_info_ptr,     # int32 (W, 2): every rank's (FLAG_* bits, T) from the layout exchange
    refuse_flagged,   # 1: run no task if any rank flagged bad input (default mode raises on the host)
    comm_programs,    # role split: the first comm_programs programs to start take the dispatch stages; 0: one queue
    recv_lag,         # plan: dispatch_recv task g follows dispatch_send task g + recv_lag (>= F1: sends first)
    gemm_group,       # plan: GEMM tasks walk the row tiles in groups of gemm_group (grouped_tile)
    table_ptr, sig_table_ptr,
    xs_off, meta_off, tiles_off, rows_off, h_off, land_off,    # bytes: plan buffers
    sig_flag, sig_rows, sig_gu, sig_land,                      # signal families (first word)
    done_send, done_recv, done_gu, done_down, bar_recv, bar_down,  # sequential-only words
    T, H, I, rank, world, E_local, MAXT, n_chunks, n_rt, n_t1, n_t2,
    F1, F2, F3, F4, NT, budget,
    s1e, s1k, s1n, s2e, s2k, s2n,  # the expert weights' strides (elements)
    put_peers,        # bit d set: reach rank d by NVSHMEM put-with-signal (runtime/transport.py; PUTS only)
    send_x_off, send_meta_off,  # bytes: this rank's symmetric send areas (W, MAXT, H) / (W, MAXT, 1 + 2K) (PUTS)
    send_land_off,    # bytes: this rank's symmetric (GEMM rows, H) down outputs before their put (PUTS)
    sig_put_tiles,    # local counters (row tile): down column tiles done of rows that go by put (PUTS)
    K: tl.constexpr, BLOCK_K: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr, SEQUENTIAL: tl.constexpr, REVERSE_RING: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, TRACE: tl.constexpr, BLOCK_W: tl.constexpr, DEVICE_TIMER: tl.constexpr = 0,
    ACT: tl.constexpr = 0, HAS_B1: tl.constexpr = False, HAS_B2: tl.constexpr = False,  # experts.py
    PUTS: tl.constexpr = False,  # the put transport is compiled in: the flag and land signals are uint64 words
):
    SIG_STRIDE: tl.constexpr = 2 if PUTS else 1  # int32 words per signal of the flag and land families
    if TRACE:  # row NT of the timer: program 0's entry and its exit from call_begin
        if tl.program_id(0) == 0:
            _stamp_timer(timer_ptr + NT * 2, DEVICE_TIMER)
    # No entry barrier: FusedMoE always launches this right after the call's layout exchange,
    # which stands in for it (primitives.call_begin says why).
    call_no, ok = call_begin(table_ptr, rank, world, budget, OPENS=False)
    if TRACE:
        if tl.program_id(0) == 0:
            _stamp_timer(timer_ptr + NT * 2 + 1, DEVICE_TIMER)
    o_w = tl.arange(0, BLOCK_W)
    if refuse_flagged != 0:  # every rank sees every rank's flags: all refuse together, no data moves
        ok = ok & (tl.max(tl.load(src_info_ptr + o_w * 2, mask=o_w < world, other=0), axis=0) == 0)
    # Dispatch chunks this call uses: those below the largest T of any rank (the layout exchange
    # gave every rank every rank's T, so all ranks agree). Chunks past it hold no token for any
    # (source, destination) pair and get no ticket: a layer sized for prefill does not walk its
    # empty chunks at decode. At least one, so that the sequential barriers are stamped
    # (MoEPlan.dispatch_chunks on the host).
    n_call = tl.cdiv(tl.max(tl.load(src_info_ptr + o_w * 2 + 1, mask=o_w < world, other=0), axis=0), BLOCK_S)
    n_call = tl.minimum(tl.maximum(n_call, 1), n_chunks)
    F1c = world * n_call   # send tickets [0, F1c), interleaved with the receive tickets [F1c, F2c)
    F2c = 2 * F1c
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    DT = x_ptr.dtype.element_ty
    # This rank's plan buffers, resolved once: a GEMM task's path to its first load is a chain of
    # dependent round trips (ticket, tile table, signal), and each base address was one more.
    p_xs = heap_ptr(table_ptr, rank, xs_off, DT)
    p_meta_all = heap_ptr(table_ptr, rank, meta_off, tl.int32)
    p_tiles = heap_ptr(table_ptr, rank, tiles_off, tl.int32)
    p_rows_all = heap_ptr(table_ptr, rank, rows_off, tl.int32)
    p_h = heap_ptr(table_ptr, rank, h_off, DT)
    p_land_own = heap_ptr(table_ptr, rank, land_off, DT)
    META: tl.constexpr = 1 + 2 * K
    o_s = tl.arange(0, BLOCK_S)
    # the last down tile's landing counters (int64 addresses) and rows, not yet published
    pend_cnt = tl.zeros((BM,), dtype=tl.int64)
    pend_m = tl.zeros((BM,), dtype=tl.int1)
    # role split (comm_programs > 0): the first comm_programs programs to arrive take the dispatch
    # stages (tickets [0, F2c)), the rest the GEMM and combine stages (tickets from F2c on);
    # without a split every program takes every ticket from the compute counter (split point 0).
    split_at = tl.where(comm_programs > 0, F2c, 0)
    on_comm = take_role(my_ctrl, comm_programs)
    # The GEMM stages take tickets only for the row tiles that hold rows: the first n_pos entries
    # of the arrival-sorted tile table (tiles without rows sort last). The plan's n_rt is a bound
    # for any routing (at T=4096 on 4 ranks, 1040 row tiles for ~272 used): a ticket per bound
    # tile cost every program ~250 empty tickets. At least one position, so that a rank without
    # rows still runs (and stamps) its sequential stage barriers.
    n_pos = tl.maximum(tl.minimum(tl.load(tile_start_ptr + E_local), n_rt), 1)
    L1 = n_pos * n_t1  # gate-up tasks [F2, G3) (in ticket terms: shifted by F2 - F2c)
    L2 = n_pos * n_t2  # down tasks [G3, G4), then the combine's NT - F4
    G3 = F2 + L1
    G4 = G3 + L2
    t, on_comm = next_task_split(my_ctrl, on_comm, split_at)
    while t < G4 - (F2 - F2c) + (NT - F4):
        busy = t >= 0  # -1: a communication program found its queue drained; no task this turn
        # Tickets [0, F2c) interleave the two dispatch stages (task_queue.py): the receive of
        # (position, chunk) g comes recv_lag sends after the send of g, so this rank's own rows
        # are placed, and their GEMM tiles can start, while remote chunks are still being sent.
        # g counts the call's n_call chunks of each position; the plan numbers all n_chunks.
        # From here on t names the task (the plan's stage-major id), not the ticket.
        is_send, q_comm = interleaved_task(t, F1c, 1, F2c - F1c, 1, recv_lag)
        q_comm = (q_comm // n_call) * n_chunks + q_comm % n_call
        t = tl.where(busy & (t < F2c), tl.where(is_send, q_comm, F1 + q_comm), tl.where(t >= F2c, t + F2 - F2c, t))
        t = _gemm_task_of_ticket(t, F2, F3, F4, G3, G4, n_pos, n_t1, n_t2, gemm_group)
        if TRACE:
            if busy:
                tl.store(trace_ptr + t * 2, tl.atomic_add(clock_ptr, 1, sem="relaxed", scope="gpu"))
                _stamp_timer(timer_ptr + t * 2, DEVICE_TIMER)
        if ok & busy:
            if t < F1:
                # ---- S0 dispatch_send: chunk c of the tokens going to rank d
                i_pos = t // n_chunks
                i_c = t % n_chunks
                if REVERSE_RING:
                    i_d = (rank + i_pos) % world
                else:
                    i_d = (rank - i_pos + world) % world
                n = tl.load(tokens_to_ptr + i_d)
                o_j = i_c * BLOCK_S + o_s
                m_j = o_j < n
                # every ticketed chunk (below the call's n_call) is stamped, empty ones too: the
                # receiver waits exactly once for each
                i_flag = sig_flag + (rank * n_chunks + i_c) * SIG_STRIDE
                by_put = False
                if PUTS:
                    by_put = ((put_peers >> i_d) & 1) != 0
                if by_put:
                    if i_c * BLOCK_S < n:  # staged into the send areas, put, then the signal
                        put_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, sig_table_ptr, i_d,
                                        rank, i_c, n, xs_off, meta_off, 0, send_x_off, send_meta_off, 0, 0, H, True,
                                        H, E_local, MAXT, i_flag, call_no, K, False, BLOCK_S, BLOCK_H)
                    else:
                        signal_after_puts(sig_table_ptr, rank, i_d, i_flag, call_no)
                else:
                    stage_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, i_d, i_d, rank, o_j,
                                      m_j, xs_off, meta_off, 0, 0, H, True, H, E_local, MAXT, w_ptr, 0, 0, K, False,
                                      BLOCK_H)
                    notify(heap_ptr(sig_table_ptr, i_d, 0, tl.int32) + i_flag, call_no)
                if SEQUENTIAL:
                    _stage_done(sig_table_ptr, rank, world, done_send, F1c, 0, call_no, False)
            elif t < F2:
                # ---- S1 dispatch_recv: place the chunk's (token, k) pairs as GEMM rows
                if SEQUENTIAL:
                    ok = ok & _stage_barrier(sig_table_ptr, rank, world, my_ctrl, done_send, F1c, 0, call_no,
                                             budget, False)
                q = t - F1
                i_pos = q // n_chunks
                i_c = q % n_chunks
                if REVERSE_RING:
                    i_s = (rank - i_pos + world) % world
                else:
                    i_s = (rank + i_pos) % world
                i_sig = sig_flag + (i_s * n_chunks + i_c) * SIG_STRIDE
                ok = ok & wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_MOE_RECV, i_sig, budget)
                n = tl.load(tokens_from_ptr + i_s)
                o_j = i_c * BLOCK_S + o_s
                m_j = (o_j < n) & ok
                r_src = (i_s * MAXT + o_j).to(tl.int64)
                p_meta = p_meta_all + r_src * META
                tok = tl.load(p_meta, mask=m_j, other=0)
                for k in tl.static_range(K):
                    el = tl.load(p_meta + 1 + k, mask=m_j, other=-1)
                    pos = tl.load(p_meta + 1 + K + k, mask=m_j, other=0)
                    valid = m_j & (el >= 0)
                    e_off = tl.load(expert_off_ptr + el, mask=valid, other=0)
                    row = (e_off + tl.load(src_off_ptr + i_s * E_local + el, mask=valid, other=0) + pos).to(tl.int64)
                    tl.store(p_rows_all + row * 4, r_src.to(tl.int32), mask=valid)      # staged row to gather
                    tl.store(p_rows_all + row * 4 + 1, i_s + 0 * pos, mask=valid)       # source rank
                    tl.store(p_rows_all + row * 4 + 2, tok, mask=valid)                 # source token
                    tl.store(p_rows_all + row * 4 + 3, k + 0 * pos, mask=valid)         # k
                    i_tile = tl.load(tile_start_ptr + el, mask=valid, other=0) + (row - e_off) // BM
                    tl.debug_barrier()
                    tl.atomic_add(p_sig + sig_rows + i_tile, 1, mask=valid, sem="release", scope="gpu")
                if SEQUENTIAL:
                    _stage_done(sig_table_ptr, rank, world, done_recv, F2c - F1c, bar_recv, call_no, True)
            elif t < F3:
                # ---- S2 gemm_gate_up: tile (i, j) once all its rows are placed
                if SEQUENTIAL:
                    ok = ok & _stage_barrier(sig_table_ptr, rank, world, my_ctrl, done_recv, F2c - F1c, bar_recv,
                                             call_no, budget, True)
                i_m, i_n, e, row0, n_rows = _gemm_tile(t - F2, n_t1, gemm_group, p_tiles)
                if (n_rows > 0) & ok:
                    if wait(p_sig + sig_rows + i_m, n_rows, my_ctrl, rank, STAGE_MOE_ROWS, sig_rows + i_m, budget):
                        up_tile(p_xs, p_rows_all, w1_ptr, p_h, e, row0, n_rows, i_n * BN1, H, I, s1e, s1k, s1n,
                                True, BM, BN1, BK1, INPUT_PRECISION, 4, ACT, b1_ptr, p_h, HAS_B1, False)
                        notify_add(p_sig + sig_gu + i_m, 1)
                if SEQUENTIAL:
                    _stage_done(sig_table_ptr, rank, world, done_gu, L1, 0, call_no, False)
            elif t < F4:
                # ---- S3 gemm_down: tile (i, j); its rows go straight to their token's rank
                if SEQUENTIAL:
                    ok = ok & _stage_barrier(sig_table_ptr, rank, world, my_ctrl, done_gu, L1, 0, call_no, budget,
                                             False)
                i_m, i_n, e, row0, n_rows = _gemm_tile(t - F3, n_t2, gemm_group, p_tiles)
                if (n_rows > 0) & ok:
                    if wait(p_sig + sig_gu + i_m, n_t1, my_ctrl, rank, STAGE_MOE_GATE_UP, sig_gu + i_m, budget):
                        acc = down_acc(p_h, w2_ptr, e, row0, n_rows, i_n * BN2, I, H, s2e, s2k, s2n,
                                       BM, BN2, BK2, INPUT_PRECISION, b2_ptr, HAS_B2)  # [BM, BN2] fp32
                        o_m = tl.arange(0, BM)
                        m_m = o_m < n_rows
                        p_rows = p_rows_all + (row0 + o_m).to(tl.int64) * 4
                        i_src = tl.load(p_rows + 1, mask=m_m, other=0)
                        i_tk = (tl.load(p_rows + 2, mask=m_m, other=0) * K + tl.load(p_rows + 3, mask=m_m, other=0)).to(tl.int64)
                        # [BM] row pointers on each row's token rank (masked rows: i_src = 0, a real rank)
                        p_land = heap_ptr(table_ptr, i_src, land_off, DT) + i_tk * H
                        o_n = i_n * BN2 + tl.arange(0, BN2)
                        m_ptr = m_m
                        if PUTS:  # rows to put peers wait in the send area for their row's last column tile
                            put_m = m_m & (((put_peers >> i_src) & 1) != 0)
                            m_ptr = m_m & (((put_peers >> i_src) & 1) == 0)
                        # the previous tile's rows had this tile's compute time to land: publish them
                        _publish_landed(pend_cnt, pend_m)
                        tl.store(p_land[:, None] + o_n[None, :], acc.to(DT), mask=m_ptr[:, None] & (o_n < H)[None, :])
                        pend_cnt = (tl.load(sig_table_ptr + i_src, mask=m_m, other=0)
                                    + (sig_land + i_tk * SIG_STRIDE) * 4)
                        pend_m = m_ptr
                        if PUTS:
                            if tl.max(put_m.to(tl.int32), axis=0) > 0:
                                _put_down_rows(acc, put_m, o_n, table_ptr, sig_table_ptr, p_sig, p_rows_all, rank,
                                               i_m, row0, n_rows, H, K, n_t2, land_off, send_land_off, sig_land,
                                               sig_put_tiles, put_peers, DT, BM)
                if SEQUENTIAL:
                    _stage_done(sig_table_ptr, rank, world, done_down, L2, bar_down, call_no, True)
            else:
                # ---- S4 combine_reduce: tokens whose every (t, k) has all its column tiles
                _publish_landed(pend_cnt, pend_m)  # before waiting: peers (and we) may wait on them
                pend_m = tl.zeros((BM,), dtype=tl.int1)
                if SEQUENTIAL:
                    ok = ok & _stage_barrier(sig_table_ptr, rank, world, my_ctrl, done_down, L2, bar_down, call_no,
                                             budget, True)
                # A call with fewer tokens than the plan's max leaves tasks without a block:
                # they take column slices of the blocks instead (plan.combine_task_split).
                n_ct = NT - F4
                n_cb = tl.cdiv(H, BLOCK_H)
                per = tl.cdiv(n_cb, tl.minimum(tl.maximum(n_ct // tl.maximum(tl.cdiv(T, BLOCK_T), 1), 1), n_cb))
                n_sl = tl.cdiv(n_cb, per)
                q = (t - F4) // n_sl
                h_lo = ((t - F4) % n_sl) * per * BLOCK_H
                o_t = q * BLOCK_T + tl.arange(0, BLOCK_T)
                o_k = tl.arange(0, BLOCK_K)
                m_t = o_t < T
                o_tk = o_t.to(tl.int64)[:, None] * K + o_k[None, :]  # [BLOCK_T, BLOCK_K]
                m_tk = m_t[:, None] & (o_k < K)[None, :]
                b_e = tl.load(topk_ptr + o_tk, mask=m_tk, other=-1)
                valid = m_tk & (b_e >= 0)
                if tl.max(m_t.to(tl.int32), axis=0) > 0:
                    ok = ok & wait_all(p_sig + sig_land + o_tk * SIG_STRIDE, n_t2 + 0 * b_e, valid & ok, my_ctrl,
                                       rank, STAGE_MOE_LAND, sig_land + q * BLOCK_T * K * SIG_STRIDE, budget)
                    if ok:
                        reduce_landed(p_land_own, topk_ptr, w_ptr, out_ptr, o_t, m_t, h_lo,
                                      tl.minimum(h_lo + per * BLOCK_H, H), H, K, True, BLOCK_T, BLOCK_H)
                        # Counters back to zero for the next call (peers add again only after the
                        # next call's layout exchange, which this rank joins once this launch has
                        # finished), by the block's last slice to get here: every slice adds 1 once
                        # past its wait, so a reset never strands a slice still waiting (the waits
                        # ask for >= n_t2).
                        tl.debug_barrier()
                        p_cnt = p_sig + sig_land + o_tk * SIG_STRIDE
                        seen = tl.atomic_add(p_cnt, 1 + 0 * b_e, mask=valid, sem="relaxed", scope="gpu")
                        tl.store(p_cnt, tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32),
                                 mask=valid & (seen == n_t2 + n_sl - 1))
        if TRACE:
            if busy:
                tl.store(trace_ptr + t * 2 + 1, tl.atomic_add(clock_ptr, 1, sem="relaxed", scope="gpu"))
                _stamp_timer(timer_ptr + t * 2 + 1, DEVICE_TIMER)
        t, on_comm = next_task_split(my_ctrl, on_comm, split_at)
    _publish_landed(pend_cnt, pend_m)
    if PUTS:
        quiet()  # this program's puts delivered (and their sources free) before the call ends
    call_end(table_ptr, rank, call_no, OPENS=False)


_SIG = {"x_ptr": "*bf16", "topk_ptr": "*i32", "pos_ptr": "*i32", "w_ptr": "*fp32", "send_idx_ptr": "*i32",
        "tokens_to_ptr": "*i32", "expert_off_ptr": "*i32", "src_off_ptr": "*i32", "tokens_from_ptr": "*i32",
        "tile_start_ptr": "*i32", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "b1_ptr": "*bf16", "b2_ptr": "*bf16",
        "out_ptr": "*bf16", "trace_ptr": "*i32",
        "timer_ptr": "*i64", "clock_ptr": "*i32", "src_info_ptr": "*i32", "refuse_flagged": "i32",
        "comm_programs": "i32", "recv_lag": "i32", "gemm_group": "i32",
        "table_ptr": "*i64", "sig_table_ptr": "*i64",
        **{n: "i64" for n in ("xs_off", "meta_off", "tiles_off", "rows_off", "h_off", "land_off")},
        **{n: "i32" for n in ("sig_flag", "sig_rows", "sig_gu", "sig_land", "done_send", "done_recv", "done_gu",
                              "done_down", "bar_recv", "bar_down", "T", "H", "I", "rank", "world", "E_local",
                              "MAXT", "n_chunks", "n_rt", "n_t1", "n_t2", "F1", "F2", "F3", "F4", "NT", "budget",
                              "s1e", "s1k", "s2e", "s2k", "put_peers", "sig_put_tiles")},
        "send_x_off": "i64", "send_meta_off": "i64", "send_land_off": "i64"}
_CONST = {"s1n": 1, "s2n": 1, "K": 8, "BLOCK_K": 8, "BLOCK_W": 8, "BM": 64, "BN1": 64, "BK1": 64, "BN2": 64, "BK2": 64, "BLOCK_S": 16,
          "BLOCK_H": 1024, "BLOCK_T": 16, "SEQUENTIAL": False, "REVERSE_RING": False,
          "INPUT_PRECISION": "tf32", "TRACE": True}
_MULT16 = ("H", "I", "xs_off", "meta_off", "tiles_off", "rows_off", "h_off", "land_off", "s1e", "s1k", "s2e", "s2k")
register_kernel(moe_fused_kernel, _SIG, _CONST, label="bf16-K8-overlap", multiples_of_16=_MULT16)
# The two variants below are compiled for AMD only (each compile takes 15-20 s of the CPU suite's
# portability check, whose NVIDIA worker has more kernels of its own): BLOCK_T=1 runs on NVIDIA in
# the GPU suite (calls of a few tokens), and arguments equal to 1 change what Triton's front end
# sees, which is the same for both targets.
# Small T plans one token per combine task (lowering.default_block_t): BLOCK_T=1 tiles.
register_kernel(moe_fused_kernel, _SIG, {**_CONST, "BLOCK_T": 1}, label="bf16-K8-overlap-combine-t1",
                multiples_of_16=_MULT16, targets=("hip",))
# Triton specialises integer arguments equal to 1 into constants (a plain int inside the kernel):
# a layer with I <= BN1 has one column tile, a small max_tokens one chunk (rank is never specialised).
_ONES = ("n_chunks", "n_t1", "n_t2")
register_kernel(moe_fused_kernel, {n: v for n, v in _SIG.items() if n not in _ONES},
                {**_CONST, **{n: 1 for n in _ONES}}, label="bf16-K8-overlap-ones", multiples_of_16=_MULT16,
                targets=("hip",))
register_kernel(moe_fused_kernel, {**_SIG, **{n: "*fp32" for n in ("x_ptr", "w1_ptr", "w2_ptr", "b1_ptr", "b2_ptr",
                                                                    "out_ptr")}},
                {**_CONST, "K": 2, "BLOCK_K": 2, "SEQUENTIAL": True, "REVERSE_RING": True,
                 "INPUT_PRECISION": "ieee", "BLOCK_H": 128, "ACT": 2, "HAS_B1": True, "HAS_B2": True},
                label="fp32-K2-sequential-gelu-bias", multiples_of_16=_MULT16)
