"""What happens to an expert a layer needs that is not resident: the miss modes a user picks from, and which one a
configuration gets when nobody said. The modes themselves run in C, inside the routing op (csrc/native_route.cpp,
csrc/surrogate.cpp):

  cpu        compute misses on the host now, and read them into slots in the background for next time;
  host       compute misses on the host from their home copy, in place, and never move an expert: where the
             slots are host memory and the home copy is host RAM too (the RAM tier, CPU compute) a copy into a
             slot is pure cost, a memcpy on the compute threads' cores for rows the host computes as fast from
             home (``computes_in_place``; the session's default there);
  wait       read the missing experts into slots now (the compute thread waits), then compute them from the slots;
             ``ordered`` refines it: the misses are late experts, computed after the layer's resident ones while
             their reads land;
  mapped     on a device whose kernels take negative expert ids (CUDA, RPC), with speculation: the device reads
             a decode ubatch's misses from the host copy in the same graph, so no layer waits for the host whatever
             it hits (csrc/mapped.cpp); experts move into slots in the background as in ``cpu``. CUDA reads pinned
             host memory in place, over the link; elsewhere a device copy of every expert stands in (device memory
             beyond the budget: for tests and the RPC device). Prompt-sized ubatches compute misses as ``cpu``;
  surrogate  APPROXIMATE, opt-in: compute a single-token miss with the expert's surrogate (its most important
             neurons; see surrogate.py) from one of top-k reserved slots, and read the full expert in the
             background for next time. Multi-token ubatches (prefill) wait, as in ``wait``.

Whatever is still not resident when the routing op returns is computed exactly on the host, so no mode but the
surrogates can change the model's output, only its speed.
"""

from __future__ import annotations

from pyspecter.tiers import Tier

MISS_MODES = ("wait", "cpu", "host", "mapped", "surrogate")


def computes_in_place(tier: Tier, host_slots: bool) -> bool:
    """Whether a miss is best computed from its home copy and never copied: the slots are host memory and the home
    copy is host RAM (the plain RAM tier on the CPU; not a device's slots, the disk, or the emulated link). A copy
    into a slot buys nothing there: on smol-moe at 50% the "cpu" mode's background copies came to 34 MB per token,
    on a reader thread that took a core from the two compute threads."""
    return tier.home == "host" and host_slots


def default_miss(tier: Tier, host_slots: bool) -> str:
    """What a miss does when nobody said: wait on the disk tier (its home copy is on disk too), host where
    ``computes_in_place``, else cpu."""
    if tier.home == "file":
        return "wait"
    return "host" if computes_in_place(tier, host_slots) else "cpu"
