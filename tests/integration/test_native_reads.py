"""Native disk reads (csrc/residency.cpp's readers, csrc/io_ring.cpp): each kind of an expert is read as aligned
chunks side by side, through io_uring where the kernel allows it or on pread threads. The chunks land the file's
bytes exactly; an expert whose chunk fails is never mapped (the host computes it); a demand still takes back or
promotes a queued prefetch of its expert. Both I/O paths, each test."""

from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.tiers import DiskTier

TOL = 1e-4
PROMPT = "Once upon a time there was a tiny mixture of experts, and it routed every token somewhere."
IOS = ["auto", "threads"]
ALIGN = 4096
CHUNK = ALIGN  # the tiny models' 8 KiB experts then span three chunks per kind, the first and last partial


def _io_uring_allowed() -> bool:
    """io_uring_setup(2) asked directly, as C's run-time choice asks it (425 on x86-64 and arm64 alike)."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    fd = libc.syscall(425, 4, params)
    if fd < 0:
        return False
    os.close(fd)
    return True


def _chunks(offset: int, n: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """The reads C cuts one kind of one expert into, as file ranges of its bytes: its aligned span in equal
    aligned pieces of at most chunk bytes."""
    start, end = offset // ALIGN * ALIGN, -(-(offset + n) // ALIGN) * ALIGN
    pieces = -(-(end - start) // chunk)
    per = -(-((end - start) // pieces) // ALIGN) * ALIGN
    spans = [(max(cs, offset), min(cs + per, offset + n)) for cs in range(start, end, per)]
    return [(lo, hi) for lo, hi in spans if hi > lo]


def _n_chunks(offset: int, n: int) -> int:
    return len(_chunks(offset, n))


def _slot_bytes(m: native.Model, il: int, kind: str, slot: int, n: int) -> bytes:
    buf = (ctypes.c_char * n)()
    assert native.slots().slot_get(m.ptr, il, native.KIND_NAMES[kind], slot, buf, n) == 0
    return buf.raw


def _stock(path, n_tokens: int | None = None) -> object:
    """Stock llama.cpp's logits of the prompt (its first n_tokens)."""
    with native.Model(path) as stock, native.Context(stock, n_threads=2) as ctx:
        return ctx.decode(stock.tokenize(PROMPT)[:n_tokens], logits_all=True)


def _check_resident_bytes(m: native.Model, lay, data: bytes) -> int:
    """Every expert mapped in a slot holds the file's bytes of it, whole; returns how many are mapped."""
    api, mapped = native.slots(), 0
    for L in lay.layers:
        for e in range(lay.n_expert):
            slot = api.slot_of(m.ptr, L.index, e)
            if slot < 0:
                continue
            mapped += 1
            for kind, t in L.tensors.items():
                off = t.expert_offset(e)
                assert _slot_bytes(m, L.index, kind, slot, t.expert_bytes) == data[off: off + t.expert_bytes], \
                    (L.index, e, kind)
    return mapped


@pytest.mark.parametrize("io", IOS)
def test_chunked_reads_land_the_files_bytes(io: str) -> None:
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    data = path.read_bytes()
    ref = _stock(path)
    want = list(range(0, lay.n_expert, 2))[: lay.n_expert // 2]
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="wait", tier=DiskTier(read_chunk=CHUNK, io=io))
        for L in lay.layers:
            assert cache.prefetch(L.index, want) == len(want)
        cache.drain()
        c = cache.counters()
        assert _check_resident_bytes(m, lay, data) == len(want) * len(lay.layers)
        with native.Context(m, n_threads=2) as ctx:
            got = ctx.decode(m.tokenize(PROMPT), logits_all=True)
        cache.check()
        after = cache.counters()
        assert _check_resident_bytes(m, lay, data) > 0
        cache.close()
    assert abs(ref - got).max() <= TOL
    kinds = [t for L in lay.layers for t in L.tensors.values()]
    expected = sum(_n_chunks(t.expert_offset(e), t.expert_bytes) for t in kinds for e in want)
    assert expected > len(kinds) * len(want)  # more than one read per kind: the chunking is what is tested
    assert c["read_ops"] == expected and c["uploads"] == len(want) * len(lay.layers)
    assert c["read_bytes"] == sum(t.expert_bytes for t in kinds) * len(want)
    assert c["failed_uploads"] == 0 and after["failed_uploads"] == 0
    assert c["io_uring"] == (1 if io == "auto" and _io_uring_allowed() else 0)
    # one queue entry per expert read whatever its chunks (the readers take them from its cursor), and drain's
    # one wait woken once, by the last read to land, not by every chunk
    assert c["queue_entries"] == c["uploads"], c
    assert c["waiter_wakes"] <= 1, c


@pytest.mark.parametrize("io", IOS)
def test_a_failed_chunk_fails_its_expert(io: str, tmp_path) -> None:
    """The file behind the readers ends halfway into one expert of the last layer: that expert's first chunks
    land, its last fails, and it is never mapped; the experts before it land whole. The output is stock's."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    data = path.read_bytes()
    ref = _stock(path)
    last = lay.layers[-1]
    cut_t = max(last.tensors.values(), key=lambda t: t.offset)  # the file's last expert tensor
    cut_expert = lay.n_expert // 2
    cut = cut_t.expert_offset(cut_expert) + cut_t.expert_bytes // 2
    short = tmp_path / "short.gguf"
    shutil.copyfile(path, short)
    os.truncate(short, cut)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="wait", tier=DiskTier(read_chunk=CHUNK, io=io))
        fd = os.open(short, os.O_RDONLY)
        os.dup2(fd, cache.tier.fd)
        os.close(fd)
        early, late = [0, 1], [cut_expert]
        assert cache.prefetch(last.index, early + late) == 3
        cache.drain()
        c = cache.counters()
        api = native.slots()
        assert all(api.slot_of(m.ptr, last.index, e) >= 0 for e in early)
        assert api.slot_of(m.ptr, last.index, cut_expert) < 0
        # every chunk is read, the short one and those past the end too; each failed chunk is a failed copy,
        # and the expert left unmapped one more
        assert c["read_ops"] == sum(
            _n_chunks(t.expert_offset(e), t.expert_bytes) for t in last.tensors.values() for e in early + late)
        failed = [hi for hi in (h for _, h in _chunks(cut_t.expert_offset(cut_expert), cut_t.expert_bytes))
                  if hi > cut]
        assert len(failed) == 2 and c["failed_uploads"] == len(failed) + 1
        _check_resident_bytes(m, lay, data)
        with native.Context(m, n_threads=2) as ctx:
            got = ctx.decode(m.tokenize(PROMPT), logits_all=True)
        cache.check()
        _check_resident_bytes(m, lay, data)
        cache.close()
    assert abs(ref - got).max() <= TOL


@pytest.mark.parametrize("io", IOS)
def test_a_demand_takes_back_a_queued_prefetch(io: str) -> None:
    """Prefetches of the first layer's experts queue behind a slow link (200 KB/s: each chunk's copy waits for it),
    the ones a token needs there last, behind about 1.4 s of others. Its routing op finds them still queued and
    takes them back whole: read again as demand reads, ahead of the rest (a prefetch partly read when its demand
    comes is promoted instead, counted in waited). The output is stock's and every mapped expert holds the file's
    bytes."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    data = path.read_bytes()
    n_slots = lay.n_expert // 2
    first = lay.layers[0].index
    with native.Model(path) as m:  # which experts the token needs in the first layer (routing is deterministic)
        tokens = m.tokenize(PROMPT)[:1]
        cache = ExpertCache(m, lay, n_slots, miss="wait", lookahead=False, record=True)
        with native.Context(m, n_threads=2) as ctx:
            ctx.decode(tokens)
        il, needed = cache.trace[0]
        cache.close()
    assert il == first and len(needed) == lay.n_expert_used
    ref = _stock(path, 1)
    order = [e for e in range(lay.n_expert) if e not in needed][: n_slots - len(needed)] + list(needed)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, n_slots, miss="wait", tier=DiskTier(read_chunk=CHUNK, io=io),
                            lookahead=False)
        native.slots().set_link_gbps(m.ptr, 0.0002)
        with native.Context(m, n_threads=2) as ctx:
            assert cache.prefetch(first, order) == n_slots
            got = ctx.decode(tokens, logits_all=True)
        native.slots().set_link_gbps(m.ptr, 0.0)
        cache.drain()
        cache.check()
        c = cache.counters()
        _check_resident_bytes(m, lay, data)
        cache.close()
    assert abs(ref - got).max() <= TOL
    assert c["failed_uploads"] == 0
    assert c["taken_back"] == len(needed), c


def _prompt_then_token(m: native.Model) -> object:
    """The logits of one decode step after the prompt (its greedy token fed back)."""
    with native.Context(m, n_threads=2) as ctx:
        logits = ctx.decode(m.tokenize(PROMPT))
        return ctx.decode([int(logits.argmax())])


def test_a_prompts_pages_go_back_on_a_reader() -> None:
    """After a prompt on the disk tier its expert pages go back (unmapped, dropped from the page cache: tens of ms
    of system calls over every layer) on a reader, not inside the routing op that sees the prompt end (its last
    layer, which routes the output row alone): one queue entry beside the prompt's reads, none in decode. The
    output is stock's."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path) as stock:
        ref = _prompt_then_token(stock)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="wait", tier=DiskTier(io="threads"),
                            lookahead=False)
        with native.Context(m, n_threads=2) as ctx:
            logits = ctx.decode(m.tokenize(PROMPT))
            cache.drain()
            prompt = cache.counters()
            cache.reset_counters()
            got = ctx.decode([int(logits.argmax())])
        cache.drain()
        c = cache.counters()
        cache.check()
        cache.close()
    assert abs(ref - got).max() <= TOL
    assert prompt["route_calls"] == c["route_calls"] == len(lay.layers)
    assert prompt["failed_uploads"] == c["failed_uploads"] == 0
    # every read queued once, and one taken back is queued again as a demand read
    assert prompt["queue_entries"] == prompt["uploads"] + prompt["taken_back"] + 1, prompt
    assert c["queue_entries"] == c["uploads"] + c["taken_back"], c


@pytest.mark.parametrize("io", IOS)
def test_a_calls_stale_lookahead_is_taken_back_not_read_in_the_decode_after(io: str) -> None:
    """A three-token prompt reads each next layer's most used experts ahead of its call (the lookahead), behind a
    slow link (200 KB/s), so most of those reads are still queued when the call comes. The call takes back the
    ones it does not need: they are never read (one partly read finishes its chunks on the wire, unmapped, and is
    no failed upload). So the decode after the prompt counts its own reads only, as bench's bytes per token count
    it: before, the prompt's leftovers landed in the decode and counted there, as many as the readers had not
    drained (a share that moved with timing: on big-qwen3moe io_uring's decode counted 1.8x the bytes of pread
    threads' for the same hits). Logits are stock's, prompt and decode, and every mapped expert holds the file's
    bytes."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    data = path.read_bytes()
    n_prompt, n_decode = 3, 4
    with native.Model(path) as stock, native.Context(stock, n_threads=2) as ctx:  # stock's, fed the same way
        tokens = stock.tokenize(PROMPT)[: n_prompt + n_decode]
        ref = [ctx.decode(tokens[:n_prompt], logits_all=True)] + [ctx.decode([t], logits_all=True)
                                                                  for t in tokens[n_prompt:-1]]
    expert_bytes = sum(t.expert_bytes for t in lay.layers[0].tensors.values())
    assert all(sum(t.expert_bytes for t in L.tensors.values()) == expert_bytes for L in lay.layers)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="wait", ordered=True,
                            tier=DiskTier(read_chunk=CHUNK, io=io))
        native.slots().set_link_gbps(m.ptr, 0.0002)
        with native.Context(m, n_threads=2) as ctx:
            got = [ctx.decode(tokens[:n_prompt], logits_all=True)]
            cache.check()
            prompt = cache.counters()
            cache.reset_counters()  # where bench starts counting a decode
            for t in tokens[n_prompt:-1]:
                got.append(ctx.decode([t], logits_all=True))
                cache.check()
            native.slots().set_link_gbps(m.ptr, 0.0)
            cache.drain()
            cache.check()
            dec = cache.counters()
        _check_resident_bytes(m, lay, data)
        cache.close()
    assert abs(np.concatenate(ref) - np.concatenate(got)).max() <= TOL
    # the decode's: one read per miss, each whole, and nothing else
    assert dec["uploads"] == dec["late"] > 0 and dec["waited"] == 0, dec
    assert dec["read_bytes"] == dec["upload_bytes"] == dec["uploads"] * expert_bytes, dec
    # the prompt's reads: the lookahead's and those its misses started (ordered: a miss in flight is promoted,
    # counted in waited); every one not taken back was read whole
    issued = prompt["lookahead"] + prompt["late"] - prompt["waited"]
    assert prompt["lookahead"] > 0 and prompt["uploads"] < issued, prompt
    assert prompt["failed_uploads"] == 0 and dec["failed_uploads"] == 0


def test_the_cpu_of_waiting_for_reads_is_kept_apart() -> None:
    """The routing op's CPU time is reported with its read waits left out, as its wall time is: the waits' own CPU
    (the kernel putting the thread to sleep and waking it) is counted apart, on the same sampled ops. Behind a
    slow link (2 MB/s: about 12 ms per expert) the waits are long, and a wait that blocks, as it must, costs a
    sliver of its wall time in CPU; the part is never more than the whole. The per-layer histogram leaves the
    waits out too: its layers with a miss sit far below one wait's 12 ms. Logits are stock's."""
    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    with native.Model(path) as stock, native.Context(stock, n_threads=2) as ctx:
        tokens = stock.tokenize(PROMPT)[:3]
        ref = [ctx.decode(tokens, logits_all=True)]
        for _ in range(31):
            ref.append(ctx.decode([int(ref[-1][-1].argmax())], logits_all=True))
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert // 2, miss="wait", tier=DiskTier(io="threads"),
                            lookahead=False)
        native.slots().set_link_gbps(m.ptr, 0.002)
        with native.Context(m, n_threads=2) as ctx:
            got = [ctx.decode(tokens, logits_all=True)]
            cache.reset_counters()
            for _ in range(31):
                got.append(ctx.decode([int(got[-1][-1].argmax())], logits_all=True))
        native.slots().set_link_gbps(m.ptr, 0.0)
        cache.check()
        c, raw = cache.counters(), native.slots().stats(m.ptr)
        cache.reset_counters()
        after_reset = cache.counters()["layer_cpu_hist"]
        cache.close()
    assert abs(np.concatenate(ref) - np.concatenate(got)).max() <= TOL
    assert c["wait_ms"] > 100 and c["uploads"] >= 60, c  # about a hundred waits, an eighth of them sampled
    assert 0 < raw.wait_cpu_ns <= raw.route_cpu_ns, (raw.wait_cpu_ns, raw.route_cpu_ns)
    assert raw.wait_cpu_ns < 0.05 * raw.wait_ns, (raw.wait_cpu_ns, raw.wait_ns)  # blocked, not spinning
    assert c["route_cpu_us_per_layer"] >= 0 and c["wait_cpu_us_per_layer"] > 0, c
    resident, missed = c["layer_cpu_hist"]
    sampled = sum(resident) + sum(missed)
    # one decode layer in 8 at random: 31 steps of every layer give about 31 * n_layer / 8
    assert raw.route_calls / 32 <= sampled <= raw.route_calls / 2, (sampled, raw.route_calls)
    # layers with a miss are told apart; a blocked wait is no CPU of theirs (each wait is 12 ms of wall)
    assert sum(missed) > 0 and 0 < c["route_cpu_us_p50_miss"] < 2000, c["route_cpu_us_p50_miss"]
    assert sum(after_reset[0]) + sum(after_reset[1]) == 0
