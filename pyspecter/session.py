"""A ready-to-use runtime: target model with expert slots, optional draft with prefetch, the decode loop.

`generate`, `chat` and the `specter` benchmark policy all build one of these, so they run the same code. This is
the one place that builds everything, frees it in the right order, and owns the draft's lifecycle (it drops a
draft that does not pay and gives its memory to the slots).

Why this module is long: that placement (tier, budget, the draft's and the predictor's bytes, held slots per layer)
and the build of every part, in the order each needs the others, are one sequence, read top to bottom.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyspecter import native
from pyspecter.budget import MemoryPlan, zero_slots
from pyspecter.cache import ExpertCache
from pyspecter.engine import SpeculativeDecoder, generate_step
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout, read_layout
from pyspecter.learned import LearnedPredictor
from pyspecter.misses import default_miss
from pyspecter.native.devices import Device, open_device
from pyspecter.native_residency import DRAFT_RATES
from pyspecter.placement import (
    DEFAULT_THREADS,
    IN_PLACE,
    NO_SLOTS,
    Placement,
    SlotCount,
    device_layer_plan,
    is_host,
    place,
    predictor_part,
    slot_count,
)
from pyspecter.predict import DraftRouting
from pyspecter.prompts import render_prompt
from pyspecter.router_ahead import is_router_ahead, router_ahead
from pyspecter.sampling import Sampler, SamplingParams
from pyspecter.speed import AnswerClock, Speed
from pyspecter.tiers import make_tier


@dataclass
class SessionConfig:
    model: Path
    draft: Path | None = None
    # where the experts live (placement.place): None leaves it to the fit to this machine (or to the device)
    budget: str | None = None  # fast-tier bytes for target expert slots; None with a tier: all experts resident
    tier: str | None = None  # ram, disk, emulated:GBPS
    device: str | None = None  # None/cpu: slots in RAM; cuda0, rpc:HOST:PORT: layers and slots on that device
    # on a device: auto, slots, n-cpu-moe:N, or a layerplan.LayerPlan (placement.device_layer_plan; None: auto)
    layer_plan: object = None
    force: bool = False  # run a budget the memory available cannot hold (refused by default, with the numbers)
    miss: str | None = None  # None: misses.default_miss (wait on the disk tier, host on the RAM tier's CPU, else cpu)
    policy: str = "lru"
    k: int = 4
    adaptive: bool = True
    temperature: float = 0.0
    # None: the model's own recommendation (general.sampling.* in its GGUF), else llama.cpp's default
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int = 0
    n_ctx: int = 2048
    n_threads: int = DEFAULT_THREADS  # one per physical core, as llama.cpp (and every command)
    min_confidence: float = 0.0
    draft_counts_in_budget: bool = True  # equal total fast memory: the draft's bytes come out of the slot budget
    profile: Path | None = None  # a trace (pyspecter trace): warm the slots with its hottest experts
    # miss="surrogate" only: per MoE layer, the neuron groups each expert's surrogate keeps
    # (pyspecter.models.calibration.select_neurons makes them; the runtime does not build artifacts)
    surrogate_groups: dict[int, np.ndarray] | None = None
    # a learned routing predictor (pyspecter fit-predictor): "auto" uses the one fitted for this model file if there
    # is one, "off" none, else a path. Without a draft it drives the prefetch plan; its bytes are in the budget.
    predictor: str = "auto"


def check_draft(target: ModelLayout, draft: ModelLayout) -> None:
    """A draft must route like the target: same MoE layers and experts (its routing indexes the target's slots).
    Its arch may differ: smol-moe's self-draft is a granitemoe file routing with the target's llama routers
    (models/smol_draft.py); the vocabularies are compared once both are loaded. Checked before anything is loaded."""
    where = f"{draft.path}: draft"
    if draft.is_moe and ([L.index for L in draft.layers] != [L.index for L in target.layers]
                         or draft.n_expert != target.n_expert):
        raise SpecterError(f"{where} has {draft.n_expert} experts in {len(draft.layers)} MoE layers, the target "
                           f"{target.n_expert} in {len(target.layers)}")


def load_predictor(spec: str | None, model: Path) -> LearnedPredictor | None:
    """The learned predictor a session uses: "auto" (the sidecar fitted for this exact file, if any), "off", or a
    path (an error if it cannot be read or was fitted for another file)."""
    if spec in (None, "off"):
        return None
    if spec == "auto":
        return LearnedPredictor.for_model(model)
    return LearnedPredictor.load(spec)


def check_device_memory(device: Device, layout: ModelLayout, plan: MemoryPlan, draft_bytes: int) -> None:
    """Refuse, with the numbers, a placement the device cannot hold: non-expert weights, the slots and the draft
    go there (compute buffers come on top, so this is a floor)."""
    free, _total = device.memory()
    slot_bytes = plan.slots * sum(L.expert_bytes for L in layout.layers)
    asked = plan.budget_bytes if plan.budget_bytes is not None else slot_bytes
    need = layout.nonexpert_bytes + max(asked, slot_bytes + draft_bytes)
    if need > free:
        gib = 2**30
        raise SpecterError(f"{device.name}: {need / gib:.2f} GiB needed (non-expert weights "
                           f"{layout.nonexpert_bytes / gib:.2f} GiB + budget {max(asked, slot_bytes) / gib:.2f} GiB) "
                           f"but the device has {free / gib:.2f} GiB free; lower --budget")


def sampling_params(cfg: SessionConfig, layout: ModelLayout) -> SamplingParams:
    """What the user set, else what the model recommends, else llama.cpp's defaults (greedy stays greedy)."""
    given = {name: getattr(cfg, name) for name in ("top_k", "top_p", "min_p", "repeat_penalty")
             if getattr(cfg, name) is not None}
    model = {k: v for k, v in layout.sampling.items() if k != "temperature"}
    return SamplingParams(**{**model, **given, "temperature": cfg.temperature}).check()


class Session:
    def __init__(self, cfg: SessionConfig, placement: Placement | None = None,
                 notify: Callable[[str], None] | None = None) -> None:
        """``placement``: where the experts live, when the caller already chose it (``placement.place``, which
        the session calls itself otherwise); ``notify``: hears a line before long work the user waits for (the
        layer plan's first measurement on a device)."""
        # what pyspecter.load says about the session (its notify lines), and an approximate mode's measured cost
        # (quality.perplexity_delta): set by load, which opens every session a user asks for
        self.notes: list[str] = []
        self.quality: dict | None = None
        self.layout = read_layout(cfg.model).require_moe()
        self.placement = placement or place(self.layout, tier=cfg.tier, budget=cfg.budget, device=cfg.device,
                                            force=cfg.force)
        p = self.placement
        cfg = self.cfg = dataclasses.replace(cfg, tier=p.tier, budget=p.budget, device=p.device)
        dlay = None
        if cfg.draft:
            dlay = read_layout(cfg.draft)
            check_draft(self.layout, dlay)
        self.tier = make_tier(cfg.tier)
        self.sampling = sampling_params(cfg, self.layout)
        # host slots (no device) over a RAM home copy: misses computed in place, nothing copied (default_miss)
        self.miss = cfg.miss or default_miss(self.tier, host_slots=is_host(p.device))
        self.surrogates = None
        if self.miss == "surrogate":
            from pyspecter.surrogate import Surrogates

            if cfg.surrogate_groups is None:
                raise SpecterError("miss mode 'surrogate' needs the surrogates' neuron groups: open the session with "
                                   "pyspecter.load(miss='surrogate'), which builds them")
            self.surrogates = Surrogates(self.layout, cfg.surrogate_groups)
        self.draft_bytes = Path(cfg.draft).stat().st_size if cfg.draft else 0
        # miss mode host moves nothing: no prefetch to plan, no eviction to rank; mapped: a predictor reads each
        # layer's input mid-token, which keeps the host paths the device's reads of the misses are there to remove
        self.predictor = (None if cfg.budget is None or self.miss in ("host", "mapped")
                          else load_predictor(cfg.predictor, cfg.model))
        if self.predictor is not None and self.surrogates is not None:
            # approximate misses are measured (quality and speed) against plain eviction, not a predictor's
            self.predictor = None
        self.device = open_device(cfg.device)
        # full, host and slot layers on a device (None: slots in every layer); a plan's layers are not all slots,
        # which the learned predictor's tables index
        why_not = "a draft" if cfg.draft else "surrogates" if self.surrogates else None
        why_not = why_not or (f"the {self.tier.name} tier" if self.tier.name != "ram" else None)
        # --miss mapped: the cost model prices slot layers without the host visit they no longer take; no --miss:
        # both ways where the device reads the host copy in place, and the session runs the faster
        self.layer_plan = device_layer_plan(self.layout, self.device, cfg.budget, cfg.layer_plan, why_not=why_not,
                                            mapped=None if cfg.miss is None else self.miss == "mapped",
                                            draft_bytes=self.draft_bytes, n_threads=cfg.n_threads, say=notify) \
            if self.device is not None else None
        if self.layer_plan is not None:
            self.predictor = None
            if self.layer_plan.mapped:
                self.miss = "mapped"
        if self.predictor is None and self._router_ahead_wanted():
            # no fitted predictor: the next layer's own router predicts its routing (router_ahead.py), for the
            # native planner alone (eviction stays cfg.policy)
            self.predictor = router_ahead(cfg.model, self.layout)
        if self.predictor is not None and not self._plans_ahead():
            # the layer-ahead maps would sit unused beside the slots: hold (and count in the budget) only what
            # eviction reads (smol-moe at 50%: 239 slots instead of 236)
            self.predictor = self.predictor.reuse_only()
        # On the CPU, what whole slot rows leave of the budget is spent too, by layer (otherwise a 5 MiB predictor
        # would cost smol-moe a whole 50 MB row of slots): one more slot per layer while it lasts, or by the
        # predictor's miss curves where they promise clearly fewer misses (budget.allocate_slots)
        try:
            self.plan = self._memory_plan()
        except SpecterError:
            if not (cfg.draft and self.predictor is not None):
                raise
            self.predictor = None  # a budget that fits the draft but not the predictor beside it runs without it
            self.plan = self._memory_plan()
        if self.miss == "host" and not self.layer_plan:
            # misses computed in place from a home copy in the same memory: a slot would never be filled, so the
            # budget buys none beyond the top-k floor the routing op is built on (the rest of it stays free)
            self.plan = MemoryPlan(self.layout.n_expert_used, budget_bytes=self.plan.budget_bytes)
        # held_extra: layer -> slots it holds beyond `held` (the draft's memory comes back as the engine's spread)
        self.n_slots, self.held = self.plan.slots - self.plan.held, self.plan.held
        self.held_extra = self.plan.held_extra
        if self.device is not None and self.layer_plan is None:
            check_device_memory(self.device, self.layout, self.plan, self.draft_bytes)
        # every expert resident in RAM: llama.cpp as users run it (its repacked weights where the CPU has kernels
        # for them), with no slots, no routing hook and no second copy of the experts
        self.stock = p.stock and self.surrogates is None
        # on the disk tier the experts live in the file: loading must not read them all (patch 0005)
        # slots upload from, and mapped misses read, the host experts: pinned beside a device that has such memory
        slots = self.layer_plan is None or bool(self.layer_plan.plan.layers("slots"))
        self.target = native.Model(cfg.model, device=self.device, lazy_experts=self.tier.name == "disk",
                                   extra_bufts=self.stock, pinned=slots and not self.stock,
                                   host_layers=self.layer_plan.plan.host_layers if self.layer_plan else None)
        if self.miss == "mapped" and cfg.miss is None and not self.target.pinned:
            # the plan's misses read pinned host experts in place; where that memory was refused (Model said so)
            # the same layers compute them on the CPU
            self.miss = "cpu"
        self.cache = self.tctx = self.decoder = self.draft = self.dctx = self.routing = None
        self.target_splits: tuple[int, int] | None = None
        try:
            self._build(dlay)
        except BaseException:
            self.close()
            raise
        self.speed = Speed()  # decode apart from prefill (speed.py): what stats() reports
        self.sampler = Sampler(self.sampling, cfg.seed)

    def _plans_ahead(self) -> bool:
        """Whether the native planner prefetches from the predictor's layer-ahead maps: where the link has time
        to spare (a device, an emulated link; the disk tier with router-ahead maps, where the planner's link-bound
        rule, max_stall, decides token by token), and not beside a draft, whose routing is that session's
        prediction."""
        if self.draft_bytes:
            return False
        if self.device is not None or self.tier.name.startswith("emulated"):
            return True
        return self.tier.name == "disk" and self.predictor is not None and is_router_ahead(self.predictor)

    def _router_ahead_wanted(self) -> bool:
        """The disk tier with no fitted predictor, slots to fill and nothing that keeps residency in Python: on
        big-qwen3moe the link idles 63% of a token (compute 336 of 532 ms), so reads predicted a layer ahead
        hide behind it. Not on smol-moe's disk tier, link-bound (stalled 75% of a token) and fitted: there the
        planner's prefetches cost more reads than they saved (``_build_cache``)."""
        cfg = self.cfg
        return (cfg.predictor == "auto" and cfg.budget is not None and not self.draft_bytes
                and self.tier.name == "disk" and self.device is None and self.surrogates is None)

    def _memory_plan(self) -> MemoryPlan:
        cfg = self.cfg
        if self.layer_plan:
            return MemoryPlan(self.layer_plan.plan.n_slots)
        return MemoryPlan.for_budget(self.layout, cfg.budget, draft_bytes=self.draft_bytes,
                                     count_draft=cfg.draft_counts_in_budget,
                                     surrogate_bytes=self.surrogates.nbytes if self.surrogates else 0,
                                     predictor_bytes=self.predictor.nbytes if self.predictor else 0,
                                     spread=True, device=self.device,
                                     curves=self.predictor.miss_curves if self.predictor else None)

    def _build(self, dlay: ModelLayout | None) -> None:
        cfg = self.cfg
        if not self.stock and (self.layer_plan is None or self.layer_plan.has_slots):
            # (a routing draft's prefetches are scored in C: csrc/draft.cpp)
            self._build_cache(record=False)
        elif cfg.profile is not None:  # nothing to warm with every expert resident, but a wrong file is refused
            from pyspecter.predict import routing_profile

            routing_profile(cfg.profile, self.layout)
        self.tctx = native.Context(self.target, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads)
        self.target_splits = native.graph_splits()  # host round trips of the target's graphs (bench reports them)
        if dlay is not None:
            # a draft lives whole on the device (its bytes are in the budget)
            self.draft = native.Model(cfg.draft, device=self.device, n_cpu_moe=0 if self.device else None)
            if self.draft.n_vocab != self.target.n_vocab:
                raise SpecterError(f"{cfg.draft}: draft vocabulary ({self.draft.n_vocab}) differs from the target's")
            # its routing predicts what to prefetch into the slots: nothing to do without them
            self.routing = DraftRouting(self.draft, dlay) if dlay.is_moe and self.cache is not None else None
            self.dctx = native.Context(self.draft, n_ctx=cfg.n_ctx, n_threads=cfg.n_threads)
            self.decoder = SpeculativeDecoder(self.tctx, self.dctx, k=cfg.k, adaptive=cfg.adaptive,
                                              routing=self.routing, slots=self.cache if self.routing else None,
                                              min_confidence=cfg.min_confidence, temperature=self.sampling,
                                              seed=cfg.seed, predict_at_k0=self.n_slots < self.layout.n_expert,
                                              drop_draft=self._drop_draft if self.held or self.held_extra else None,
                                              close_draft=self._close_draft)
            if self.cache is not None:
                self.decoder.check = self.cache.check
        self.tctx.warmup()
        if self.dctx is not None:
            self.dctx.warmup()

    def _build_cache(self, record: bool) -> None:
        cfg = self.cfg
        # wait mode computes a layer's resident experts while its misses land (measured: 1.21-1.22x at 30% on
        # the disk tier, level at 50%; exact either way)
        # The learned predictor runs inside the routing op: its reuse maps (and their duel with LRU) evict, its
        # layer-ahead maps feed the native planner, which prefetches the next layers of the token being computed
        # while the readers can land them in time. Nothing of it calls into Python inside a layer.
        learned = self.predictor is not None and self.n_slots < self.layout.n_expert
        # router-ahead maps (no fitted predictor) only prefetch: no reuse maps, eviction by cfg.policy
        fitted = learned and not is_router_ahead(self.predictor)
        # ... where the link has time to spare: a device, or an emulated link. Not on the CPU tiers, measured quiet
        # on smol-moe: on the RAM tier a prefetch is a memcpy by a reader thread on the compute threads' cores (the
        # planner read 55 MB per token against LRU's 32 and decoded at 1.49x all-resident against LRU's 1.28x);
        # on the disk tier, 67-76% stalled on reads, its prefetches took the link from the misses waited for (40.2
        # MB per token against LRU's 37.3 at 50%; 58.1 against the reuse maps alone's 54.3 at 30%).
        ahead = learned and self._plans_ahead()
        # a plan's hot slot layers hold a hot set: no residency engine, nothing moves inside a layer (the set is
        # re-chosen between decodes, ExpertCache.adapt)
        hot = self.layer_plan is not None and self.layer_plan.plan.hot
        self.cache = ExpertCache(self.target, self.layout, self.n_slots + self.held, hook=not hot,
                                 policy="predicted" if fitted else cfg.policy, miss=self.miss, tier=self.tier,
                                 surrogates=self.surrogates, ordered=self.miss == "wait", held=self.held,
                                 record=record,
                                 held_extra=self.held_extra, extra=self.plan.extra,
                                 kinds=self.layer_plan.plan.native_kinds() if self.layer_plan else None,
                                 reuse=self.predictor if fitted else None, ahead=self.predictor if ahead else None)
        if self.surrogates is not None:
            self.surrogates.release()  # C holds its own copy of the kept bytes
        if hot:  # the given profile, else the one the plan priced the hot set with; then the text's own routing
            from pyspecter.hitrates import hot_profile
            from pyspecter.predict import routing_counts

            self.cache.warm_hot(routing_counts(cfg.profile, self.layout) if cfg.profile is not None
                                else hot_profile(cfg.model, self.layout, cfg.n_threads), adapt=True)  # hotset.py
        elif cfg.profile is not None:
            from pyspecter.predict import routing_profile

            order = routing_profile(cfg.profile, self.layout)
            self.cache.warm({il: e for il, e in order.items() if il in self.cache.layer_pos})  # a plan's slot layers

    def _drop_draft(self) -> None:
        """The engine measured that the draft does not pay: free it, and give its memory to the slots."""
        self._close_draft()
        self.cache.release_held()
        self.n_slots += self.held
        # the plan says what the layers hand out now: the held slots are usable, each layer's share of them too
        p = self.plan
        self.plan = dataclasses.replace(p, held=0, held_extra={}, extra={
            il: p.extra.get(il, 0) + p.held_extra.get(il, 0) for il in {*p.extra, *p.held_extra}})
        self.held, self.draft_bytes, self.held_extra = 0, 0, {}

    def _close_draft(self) -> None:
        if self.routing is not None:
            self.routing.close()
            self.routing = None
        if self.dctx is not None:
            self.dctx.close()
            self.dctx = None
        if self.draft is not None:
            self.draft.close()
            self.draft = None

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special=add_special)

    def stream(self, prompt: list[int], *, stop_at_eog: bool = True, reuse: bool = False) -> Iterator[int]:
        """Tokens after ``prompt`` as they are decided (speculatively with a draft): from a fresh context, or with
        ``reuse`` keeping what the KV cache already holds of ``prompt`` (a chat turn processes only what is new).
        Each token counts in ``stats()`` as it is yielded, with the time spent deciding it (``speed.AnswerClock``):
        not the caller's between tokens, and a caller that stops early counts what it took."""
        clock = self._clock()
        gen = self._tokens(prompt, stop_at_eog=stop_at_eog, reuse=reuse)
        try:
            for tok in gen:
                clock.token()
                yield tok
                clock.resume()
        finally:
            gen.close()

    def _clock(self) -> AnswerClock:
        """A clock for one answer into ``self.speed``, counting the prompt tokens the target's prefill runs."""
        before = self.tctx.n_decoded
        return AnswerClock(self.speed, prefilled=lambda: self.tctx.n_decoded - before)

    def _tokens(self, prompt: list[int], *, stop_at_eog: bool, reuse: bool) -> Iterator[int]:
        """``stream``'s tokens, counted by the caller."""
        if not prompt:
            raise SpecterError("empty prompt: nothing to continue from (this model adds no BOS token)")
        if self.decoder is not None:
            yield from self.decoder.stream(prompt, stop_at_eog=stop_at_eog, reuse=reuse)
            return
        if reuse:
            todo = self.tctx.reuse(prompt)
        else:
            self.tctx.clear()
            todo = prompt
        for tok, _ in generate_step(self.tctx, todo, self.sampler, history=prompt):
            if self.cache is not None:
                self.cache.check()
                self.cache.adapt()  # between decodes: a hot set follows the text
            yield tok
            if stop_at_eog and self.target.is_eog(tok):
                return

    def generate(self, prompt: list[int], n: int, on_token: Callable[[int], None] | None = None,
                 stop_at_eog: bool = True, reuse: bool = False) -> list[int]:
        """Decode up to n tokens after prompt, from a fresh context (or reusing the cached prefix)."""
        if not prompt:
            raise SpecterError("empty prompt: nothing to continue from (this model adds no BOS token)")
        if n <= 0:  # llama.cpp's -n 0 decodes nothing, not even the prompt
            return []
        clock = self._clock()
        out: list[int] = []

        def emit(tok: int) -> None:
            clock.token()
            out.append(tok)
            if on_token:
                on_token(tok)
            clock.resume()  # the caller's time with the token is not decode time

        if self.decoder is not None:
            # the decoder's own bounded loop: it never drafts past n
            self.decoder.generate(prompt, n, stop_at_eog=stop_at_eog, on_token=emit, reuse=reuse)
        else:
            gen = self._tokens(prompt, stop_at_eog=stop_at_eog, reuse=reuse)
            try:
                for tok in gen:
                    emit(tok)
                    if len(out) >= n:
                        break
            finally:
                gen.close()
        if self.cache is not None:
            self.cache.check()
        return out

    def slot_count(self) -> SlotCount:
        """The slots as every command says them (``placement.SlotCount``), with what else takes the budget."""
        if self.cache is None:
            return NO_SLOTS
        others = [predictor_part(self.predictor)] if self.predictor else []
        if self.held:
            others.append(("the draft (its slots held until it is dropped)", self.draft_bytes))
        elif self.draft_bytes and self.cfg.draft_counts_in_budget:
            others.append(("the draft", self.draft_bytes))
        if self.surrogates is not None:
            others.append(("the surrogates", self.surrogates.nbytes))
        if self.miss == "host" and not self.layer_plan and self.plan.budget_bytes is not None:
            used = self.n_slots * sum(L.expert_bytes for L in self.layout.layers)
            if self.plan.budget_bytes > used:
                others.append((IN_PLACE, self.plan.budget_bytes - used))
        if self.layer_plan is not None:  # slots in the plan's slot layers only
            n = self.layer_plan.plan.n_slots
            return SlotCount(tuple(n for _ in self.layer_plan.plan.layers("slots")), self.layout.n_expert,
                             tuple(others), zero=self.layer_plan.plan.n_zero)
        return slot_count(self.layout, self.plan, tuple(others), zero=zero_slots(self.layout, self.device))

    def stats(self) -> dict:
        if self.cache is None:  # stock: every expert resident, nothing moves
            c = {"hit_rate": 1.0, "slot_row_rate": 1.0, "uploads": 0, "upload_bytes": 0, "prefetches": 0,
                 "hook_ms": 0.0, "surrogate_uses": 0, "failed_uploads": 0}
        else:
            c = self.cache.counters()
        count = self.slot_count()
        out = {"stock": self.cache is None and self.layer_plan is None,
               **self.speed.as_stats(), **count.as_stats(),
               # slots every MoE layer has (0: none); slots_min, slots_mean and slots_max say how layers differ
               "slots_per_layer": count.min, "has_slots": self.cache is not None,
               "n_expert": self.layout.n_expert, "tier": self.tier.name,
               "miss": self.miss, "hit_rate": c["hit_rate"], "coverage": c["slot_row_rate"],
               "uploads": c["uploads"], "upload_mib": c["upload_bytes"] / 2**20, "prefetches": c["prefetches"],
               "stall_ms": c["hook_ms"], "draft_mib": self.draft_bytes / 2**20,
               "surrogate_uses": c["surrogate_uses"], "failed_uploads": c["failed_uploads"]}
        if self.layer_plan is not None:
            out["slots_text"] = f"layer plan {self.layer_plan.plan.describe(self.layout)}"
        fitted = self.predictor is not None and not is_router_ahead(self.predictor)
        duel_c = self.cache.duel_state() if fitted else None
        if duel_c is not None:  # the duel runs in C: which eviction it chose now
            out.update(evict="learned" if duel_c[0] else "lru", evict_switches=duel_c[1], native=True)
        if self.predictor is not None:
            out.update(predictor_mib=self.predictor.nbytes / 2**20,
                       predictor="fitted" if fitted else "router-ahead")
        if self.cache is not None and self.cache.native and self.predictor is not None:
            # the native planner: prefetches from the layer-ahead maps, and predictions left to the miss path
            out.update(plan_prefetches=c["ahead_prefetches"], plan_skipped_late=c["ahead_late"],
                       plan_refused=c["ahead_refused"], plan_maps=c["ahead_maps"])
        if self.decoder is not None:
            s = self.decoder.stats
            out.update(acceptance=s.acceptance, mean_k=s.mean_k, steps=s.steps, draft_off=s.draft_off,
                       draft_dropped_at=s.dropped_at, drafted=s.drafted, accepted=s.accepted,
                       draft_prefetches=s.prefetches, draft_prefetches_used=s.prefetches_used,
                       draft_prefetch_precision=s.prefetch_precision, draft_prefetch_mib=s.prefetch_bytes / 2**20,
                       draft_prefetch_stopped_at=s.prefetch_stopped_at)
            # C's measures of the draft's windows, beside what plain LRU would have hit on the same calls
            out.update({k: c[k] for k in DRAFT_RATES if k in c})
        return out

    def reset_stats(self) -> None:
        if self.cache is not None:
            self.cache.reset_counters()
        self.speed.reset()

    def close(self) -> None:
        """Free everything, uploads drained first: they write into the target's slots."""
        if self.cache is not None:
            self.cache.close()  # idempotent; its counters stay readable after close
        if self.tctx is not None:
            self.tctx.close()
            self.tctx = None
        self._close_draft()
        if self.target is not None:
            self.target.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_chat_template(model: native.Model, messages: list[dict[str, str]]) -> str:
    """The model's own chat template through llama.cpp (ChatML for models without one it knows)."""
    return render_prompt(model, messages)
