"""Tensor snapshots on the worker: which tensors to capture (`SnapshotRules`), how to read
decoder-layer outputs (`LayerCapture`, forward hooks that work on our models and on
transformers' alike) and per-step records for the snapshot sink (`StepSnapshots`).

A request's *step* is the index of the output token a forward pass produces: 0 is the prefill
(every chunk of it), k the pass that samples output token k. It does not depend on batching
or preemption, so a rule like `steps=0-3` means the same thing on every run.

Records are built only for matching (request, step) pairs: with no match the hooks return at
once, and with no rules at all no hook is registered.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from axonserve.protocol import tensor_ref
from axonserve.protocol.messages import SnapshotRecord, caller_request_id

if TYPE_CHECKING:  # torch is imported where used: parsing rules (the CLI) must not need it
    import torch
    from torch import nn

TENSOR_KINDS = ("inputs", "hidden", "logits")
Ranges = tuple[tuple[int, int], ...]  # inclusive (lo, hi) pairs; hi = -1: no upper bound

RULES_HELP = (
    "RULES is `key=value` items separated by commas or semicolons, a bare value after a "
    "comma extending the previous key's list: requests=<id|glob|all>[,...] (default all), "
    "steps=<N|A-B|A-|all>[,...] (the output-token index a forward produces, 0 = prefill; "
    "default all), tensors=inputs,hidden,logits (default all three), layers=<N|A-B>[,...] "
    "(decoder layers for hidden; default all). Example: "
    "'requests=cmpl-*,steps=0-3,tensors=inputs,hidden,logits'. A JSON object with the same "
    "keys (lists or strings) is accepted too."
)


class SnapshotRules(msgspec.Struct, frozen=True, kw_only=True):
    """Which requests, steps, tensors and layers to capture. `None` means all."""

    requests: tuple[str, ...] | None = None  # exact ids or fnmatch globs
    steps: Ranges | None = None
    tensors: tuple[str, ...] = TENSOR_KINDS
    layers: Ranges | None = None

    @classmethod
    def parse(cls, text: str) -> SnapshotRules:
        """From the compact `key=value,...` form or JSON; ValueError names what is wrong."""
        text = text.strip()
        if not text:
            raise ValueError("empty --snapshot rules")
        if text.startswith("{"):
            raw = msgspec.json.decode(text)
            if not isinstance(raw, dict):
                raise ValueError("--snapshot JSON must be an object")
            items = {k: v if isinstance(v, list) else [str(v)] for k, v in raw.items()}
        else:
            items = _split_items(text)
        unknown = set(items) - {"requests", "steps", "tensors", "layers"}
        if unknown:
            raise ValueError(f"unknown --snapshot key(s) {sorted(unknown)}; known: requests, steps, tensors, layers")
        kw: dict[str, Any] = {}
        if "requests" in items:
            reqs = tuple(str(r) for r in items["requests"] if str(r))
            kw["requests"] = None if "all" in reqs or "*" in reqs else reqs
        if "steps" in items:
            kw["steps"] = _parse_ranges(items["steps"], "steps")
        if "layers" in items:
            kw["layers"] = _parse_ranges(items["layers"], "layers")
        if "tensors" in items:
            kinds = tuple(dict.fromkeys(str(t) for t in items["tensors"]))
            if "all" in kinds:
                kinds = TENSOR_KINDS
            bad = [k for k in kinds if k not in TENSOR_KINDS]
            if bad or not kinds:
                raise ValueError(f"--snapshot tensors must be among {', '.join(TENSOR_KINDS)}; got {bad or 'none'}")
            kw["tensors"] = kinds
        return cls(**kw)

    def wants_request(self, request_id: str) -> bool:
        if self.requests is None:
            return True
        return any(request_id == p or fnmatch.fnmatchcase(request_id, p) for p in self.requests)

    def wants_step(self, step: int) -> bool:
        return _in_ranges(step, self.steps)

    def wants_layer(self, layer: int) -> bool:
        return _in_ranges(layer, self.layers)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> SnapshotRules:
        return msgspec.json.decode(text, type=cls)


def _split_items(text: str) -> dict[str, list[str]]:
    items: dict[str, list[str]] = {}
    key: str | None = None
    for tok in (t.strip() for part in text.split(";") for t in part.split(",")):
        if not tok:
            continue
        if "=" in tok:
            key, _, val = tok.partition("=")
            key = key.strip().lower()
            items.setdefault(key, [])
            tok = val.strip()
            if not tok:
                continue
        if key is None:
            raise ValueError(f"--snapshot item {tok!r} has no key (expected key=value)")
        items[key].append(tok)
    return items


def _parse_ranges(values: Sequence[Any], what: str) -> Ranges | None:
    out = []
    for v in values:
        s = str(v).strip()
        if s in ("all", "*"):
            return None
        lo, sep, hi = s.partition("-")
        try:
            a = int(lo)
            b = (int(hi) if hi else -1) if sep else a
        except ValueError:
            raise ValueError(f"--snapshot {what}: {s!r} is not N, A-B or A-") from None
        if a < 0 or (b != -1 and b < a):
            raise ValueError(f"--snapshot {what}: bad range {s!r}")
        out.append((a, b))
    return tuple(out) or None


def _in_ranges(x: int, ranges: Ranges | None) -> bool:
    return ranges is None or any(lo <= x and (hi == -1 or x <= hi) for lo, hi in ranges)


# --------------------------------------------------------------------------- layer capture


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM, ours or transformers' (`<lm>.model.layers`, or the
    first `layers`/`h`/`blocks` ModuleList found)."""
    from torch import nn

    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return list(mod)
    raise ValueError(f"{type(model).__name__}: no decoder layer list found for hidden-state capture")


class LayerCapture:
    """Forward hooks on every decoder layer; while armed, each layer's output rows are kept.

    The output is flattened to [tokens, hidden] (a batched [B, T, H] model contributes B*T
    rows), a tuple output contributes its first element, and only `rows` are copied out (so
    later in-place updates cannot change what was captured)."""

    def __init__(self, model: nn.Module, want_layer: Callable[[int], bool] | None = None):
        self.layers = decoder_layers(model)
        self._rows: torch.Tensor | None = None
        self._armed = False
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [
            layer.register_forward_hook(self._hook(i))
            for i, layer in enumerate(self.layers)
            if want_layer is None or want_layer(i)
        ]

    def _hook(self, index: int) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
            if not self._armed:
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            flat = out.detach().reshape(-1, out.shape[-1])
            self.outputs[index] = flat.clone() if self._rows is None else flat.index_select(0, self._rows)

        return hook

    def arm(self, rows: torch.Tensor | None = None) -> None:
        """Capture the next forward: only `rows` of the flattened output (all when None)."""
        self._rows, self._armed, self.outputs = rows, True, {}

    def disarm(self) -> dict[int, torch.Tensor]:
        """Stop capturing; return {layer index: [rows, hidden]}."""
        self._armed, self._rows = False, None
        out, self.outputs = self.outputs, {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# --------------------------------------------------------------------------- worker side


@dataclass
class _Item:
    request_id: str
    step: int
    rows: list[int]  # rows of the forward's flat batch holding this request's tokens
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    offset: int = 0  # first row of this item in the captured (concatenated) rows


class StepSnapshots:
    """Builds `SnapshotRecord`s for the (request, step) pairs the rules select.

    The runner calls `begin` before the forward (rows of each scheduled request in the flat
    batch), `add_logits` before sampling (raw logits, before any penalty or temperature), and
    the worker takes the finished records with `take()` after the step."""

    def __init__(self, model: nn.Module, rules: SnapshotRules, rank: int = 0):
        self.rules, self.rank = rules, rank
        self.capture = LayerCapture(model, rules.wants_layer) if "hidden" in rules.tensors else None
        self._items: dict[str, _Item] = {}
        self._wanted: dict[str, bool] = {}  # request id -> rules match (globs are not free per step)
        self._step_id = 0
        self._pending: list[tuple[SnapshotRecord, list[torch.Tensor]]] = []

    @staticmethod
    def from_config(model: nn.Module, rules_json: str, rank: int) -> StepSnapshots | None:
        """None unless snapshots are on and this is rank 0 (every rank holds full activations)."""
        if not rules_json or rank != 0:
            return None
        return StepSnapshots(model, SnapshotRules.from_json(rules_json), rank)

    def begin(
        self, step_id: int, scheduled: Iterable[tuple[Any, list[int]]], input_ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """`scheduled`: (request state, flat-batch rows) before this step's tokens are counted."""
        import torch

        self._finish()
        self._step_id = step_id
        r = self.rules
        for st, rows in scheduled:
            step = len(st.token_ids) - st.num_prompt_tokens
            if rows and self._wants(st.request_id) and r.wants_step(step):
                self._items[st.request_id] = _Item(st.request_id, step, list(rows))
        if not self._items:
            return
        all_rows = [i for it in self._items.values() for i in it.rows]
        off = 0
        for it in self._items.values():
            it.offset, off = off, off + len(it.rows)
            if "inputs" in r.tensors:
                idx = torch.tensor(it.rows, dtype=torch.long)
                it.tensors["input_ids"] = input_ids.index_select(0, idx).clone()
                it.tensors["positions"] = positions.index_select(0, idx).clone()
        if self.capture is not None:
            self.capture.arm(torch.tensor(all_rows, dtype=torch.long))

    def _wants(self, request_id: str) -> bool:
        """Rules name the caller's ids (`snap-1`, `snap-*`), not the engine's `snap-1@<tag>`."""
        hit = self._wanted.get(request_id)
        if hit is None:
            if len(self._wanted) > 65536:
                self._wanted.clear()
            hit = self._wanted[request_id] = self.rules.wants_request(caller_request_id(request_id))
        return hit

    def add_logits(self, request_ids: Sequence[str], logits: torch.Tensor | None) -> None:
        """Row j of `logits` belongs to request_ids[j] (the requests sampling this step)."""
        if logits is None or not self._items or "logits" not in self.rules.tensors:
            return
        for j, rid in enumerate(request_ids):
            it = self._items.get(rid)
            if it is not None:
                it.tensors["logits"] = logits[j : j + 1].detach().float().clone()

    def take(self) -> list[tuple[SnapshotRecord, list[torch.Tensor]]]:
        """Records completed by the last step, each with its tensors in frame order."""
        self._finish()
        out, self._pending = self._pending, []
        return out

    def _finish(self) -> None:
        if not self._items:
            return
        hidden = self.capture.disarm() if self.capture is not None else {}
        now = time.time()
        for it in self._items.values():
            for layer, h in sorted(hidden.items()):
                it.tensors[f"hidden.{layer}"] = h[it.offset : it.offset + len(it.rows)]
            names = list(it.tensors)
            tensors = [it.tensors[n] for n in names]
            refs = {n: tensor_ref(k + 1, t) for k, (n, t) in enumerate(zip(names, tensors))}  # frame 0: body
            self._pending.append(
                (
                    SnapshotRecord(
                        request_id=caller_request_id(it.request_id),
                        step=it.step,
                        step_id=self._step_id,
                        rank=self.rank,
                        tensors=refs,
                        time=now,
                    ),
                    tensors,
                )
            )
        self._items = {}

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()


def contiguous_rows(flat: Sequence[tuple[Any, int]]) -> list[tuple[Any, list[int]]]:
    """Rows of each (request, token count) in an unpadded flat batch, in batch order."""
    out, off = [], 0
    for st, n in flat:
        out.append((st, list(range(off, off + n))))
        off += n
    return out


def padded_rows(work: Sequence[tuple[Any, int]], src: Any) -> list[tuple[Any, list[int]]]:
    """Rows of each request in a bucket-padded batch, `src` mapping padded row -> unpadded
    flat index (-1 for padding; see ops.attention.build_static)."""
    import numpy as np

    out, off = [], 0
    for st, n in work:
        out.append((st, np.nonzero((src >= off) & (src < off + n))[0].tolist()))
        off += n
    return out
