"""One request's KV, moved from one compute data plane (one layout) into another.

Prefill/decode disaggregation computes a prompt's KV on a prefill pool laid out for long
prompts (token-sharded under PCP/DCP, e.g. `pcp2xdcp2`) and decodes it on a pool laid out
for many short steps (paged per DP rank, e.g. `dp2` or `tp2`). The same logical KV is
spread differently over the GPUs of the two replicas, so it crosses in a neutral form:

- **logical tensors**, per attention layer and cache name, one row per position: GQA
  `k`, `v` `[T, num_kv_heads, head_dim]` (all of the model's KV heads), MLA `latent`
  `[T, kv_lora_rank + rope_dim]`, DSA `index_k` `[T, index_head_dim]`;
- **export** (`export_kv`) assembles them from every GPU of the source replica: each PP
  stage gives its layers, each TP rank its heads (the slice starting at
  `heads_class(tp_index) * heads_here`), each DCP member the positions it owns. Copies
  (PCP members without DCP, TP ranks replicating a KV head) hold the same entries; any
  one is read. Every position, head and layer must come from some GPU, or it raises
  ValueError: a wrong layout mapping fails loudly instead of producing zeros.
- **import** (`import_kv`) cuts them again for the destination replica and writes every
  GPU's part at the slots of the request's blocks there (`PagedKV.slots`), every copy
  included, so that any GPU may later read its KV as if it had computed it.

Block tables are the KV manager's physical block ids on the DP rank in question (the two
planes' ids are unrelated); positions `start..` let a transfer skip a prefix the
destination already holds (a prefix-cache hit).

The two halves of a P/D hand-over reach the planes as step commands (`ExportKV`,
`ImportKV` in `engine/step_io.py`): `export_request` runs on the prefill side's plane
and its result travels back as a report, `import_request` on the decode side's. Each
GPU's part runs where that GPU lives, as rank operations sent through the plane's
executor (`read_kv_span`, `write_kv_span`, `read_state`, `write_state`): under
`executor="mp"` a worker process's share crosses in the operation's result or argument,
and the plane assembles (export) or checks the table (import) on the driver's side.

A hybrid model's linear-attention layers keep no per-token KV but one state per request
(`linear_state.py`), split by heads over TP: `export_state` joins the TP ranks' head
slices into whole states, `import_state` cuts them for the destination's TP ranks and
makes them the request's state at that position. It always crosses whole.
"""

from __future__ import annotations

import numpy as np
import torch

KVData = dict[int, dict[str, torch.Tensor]]


def export_kv(plane, dp_rank: int, blocks, num_tokens: int, start: int = 0,
              layers=None) -> KVData:
    """The KV of positions start..num_tokens-1 of a request whose block table on DP rank
    `dp_rank` of `plane` is `blocks` (physical block ids covering num_tokens), as full
    logical tensors per layer and cache name (see the module docstring); only `layers`
    if given (a sliding-window model's two kinds of layer have two tables). Each GPU of
    the replica reads its part where it lives (`read_kv_span`, through the plane's
    executor: a thread or a process); this side assembles them. Raises ValueError when
    the blocks do not cover the positions or when the replica's GPUs leave a position,
    head or layer uncovered."""
    table = _check_table(plane, dp_rank, blocks, num_tokens, start)
    positions = np.arange(start, num_tokens, dtype=np.int64)
    gpus = plane.mesh.replica_gpus(dp_rank)
    args = (positions, table, plane.block_size, layers)
    parts = plane.executor.run(read_kv_span, [args] * len(gpus), gpus)
    out: KVData = {}
    covered: dict[tuple[int, str], torch.Tensor] = {}
    for gpu, part in zip(gpus, parts):
        for layer, name, rows, entries in part:
            rows_t = torch.as_tensor(rows, dtype=torch.long)
            full = out.setdefault(layer, {}).get(name)
            if full is None:
                shape = _logical_shape(plane.spec, entries.shape[1:])
                full = entries.new_zeros((len(positions),) + shape)
                out[layer][name] = full
                covered[layer, name] = torch.zeros(full.shape[:_head_dims(name) + 1],
                                                   dtype=torch.bool)
            heads = _head_slice(plane.mesh, plane.mesh.places[gpu], name, entries.shape[1])
            idx = rows_t.to(full.device)
            if heads is None:
                full[idx] = entries
                covered[layer, name][rows_t] = True
            else:
                full[idx, heads] = entries
                covered[layer, name][rows_t, heads] = True
    _check_coverage(plane, dp_rank, out, covered, start, layers)
    return out


def import_kv(plane, dp_rank: int, blocks, data: KVData, start: int = 0,
              layers=None) -> None:
    """Write `data` (as `export_kv` returns it; positions start..start+T-1) into the paged
    caches of DP rank `dp_rank` of `plane` at the request's blocks `blocks`: every GPU of
    the replica takes its stage's layers, its head slice and (under DCP) its owned
    positions (`write_kv_span`, where it lives); copies are all written."""
    num_new = _num_positions(data)
    table = _check_table(plane, dp_rank, blocks, start + num_new, start)
    positions = np.arange(start, start + num_new, dtype=np.int64)
    gpus = plane.mesh.replica_gpus(dp_rank)
    args = (positions, table, plane.block_size, data, layers)
    plane.executor.run(write_kv_span, [args] * len(gpus), gpus)


def export_state(plane, dp_rank: int, request_id: str, position: int,
                 boundary: bool = False) -> dict:
    """The request's linear-attention state after `position` tokens and, with
    `boundary`, after the last block boundary before it (where the destination may
    snapshot it), every head: {position: {linear layer: state}}. Each TP rank gives its
    heads (any PCP member), each PP stage its layers (`read_state`, where they live)."""
    last = position // plane.block_size * plane.block_size
    wanted = {position: "current"} | ({last: "boundary"} if boundary and 0 < last < position
                                      else {})
    return _whole_states(plane, dp_rank, read_state, (request_id, wanted))


def export_snapshot(plane, dp_rank: int, key: int, position: int) -> dict:
    """The snapshot `key` on DP rank dp_rank (a state after `position` tokens), every
    head, as `export_state` gives a request's: {position: {linear layer: state}}."""
    return _whole_states(plane, dp_rank, read_snapshot, (key, position))


def _whole_states(plane, dp_rank: int, op, args: tuple) -> dict:
    """`op`'s per-GPU state slices on the replica's GPUs, each TP rank's heads joined."""
    gpus = plane.mesh.replica_gpus(dp_rank)
    found = plane.executor.run(op, [args] * len(gpus), gpus)
    parts: dict[tuple[int, int], dict[int, object]] = {}  # (position, layer) -> tp -> slice
    for gpu, states in zip(gpus, found):
        for key, fields in states.items():
            parts.setdefault(key, {})[plane.mesh.places[gpu].tp_index] = fields
    out: dict[int, dict[int, object]] = {}
    for (pos, layer), by_tp in parts.items():
        if sorted(by_tp) != list(range(plane.layout.tp)):
            raise ValueError(f"layer {layer}: TP ranks {sorted(by_tp)} of "
                             f"{plane.layout.tp} hold its state")
        slices = [by_tp[i] for i in range(plane.layout.tp)]
        out.setdefault(pos, {})[layer] = type(slices[0])(*(
            None if first is None else torch.cat([s[f] for s in slices], dim=_HEAD_DIM[f])
            for f, first in enumerate(slices[0])))
    return out


def import_state(plane, dp_rank: int, request_id: str, position: int, data: dict) -> None:
    """Make `data[position]` (from `export_state`) the request's state after `position`
    tokens on every GPU of the destination replica, each its TP rank's heads; keep an
    earlier boundary's state as marked (`LinearStates.mark`)."""
    gpus = plane.mesh.replica_gpus(dp_rank)
    args = (request_id, position, data, plane.layout.tp)
    plane.executor.run(write_state, [args] * len(gpus), gpus)


def export_request(plane, c) -> dict:
    """An `ExportKV` command carried out: its spans' KV (in order) and the state."""
    kv = [export_kv(plane, c.dp, s.table, s.stop, s.start, s.layers) for s in c.spans]
    state = None if c.state_position is None else \
        export_state(plane, c.dp, c.request_id, c.state_position, c.state_boundary)
    return {"kv": kv, "state": state}


def import_request(plane, c) -> None:
    """An `ImportKV` command carried out: `export_request`'s payload written in."""
    for span, data in zip(c.spans, c.payload["kv"], strict=True):
        import_kv(plane, c.dp, span.table, data, span.start, span.layers)
    if c.state_position is not None:
        import_state(plane, c.dp, c.request_id, c.state_position, c.payload["state"])


# -------------------------------------------------------------- rank operations
# Run on each GPU where it lives (executors.py): module-level, picklable arguments,
# results on the CPU under executor="mp" (the worker's `_to_cpu`).
def read_kv_span(rank, positions: np.ndarray, table: np.ndarray, block_size: int,
                 layers) -> list[tuple[int, str, np.ndarray, torch.Tensor]]:
    """What this GPU holds of the positions: (layer, cache name, rows of `positions`,
    entries) for each cache tensor of its (selected) layers."""
    kv = rank.kv
    rows, slots = _owned_slots(kv, positions, table, block_size)
    return [(layer, name, rows, _read(cache, slots, kv.local_block_size))
            for layer, named in _selected(kv, layers) for name, cache in named.items()]


def write_kv_span(rank, positions: np.ndarray, table: np.ndarray, block_size: int,
                  data: KVData, layers) -> None:
    """Write this GPU's part of `data` (its layers, heads, owned positions)."""
    kv = rank.kv
    _check_data(rank, data, layers)
    rows, slots = _owned_slots(kv, positions, table, block_size)
    for layer, named in _selected(kv, layers):
        mine = {}
        for name, cache in named.items():
            values = data[layer][name].to(cache.device)
            values = values[torch.as_tensor(rows, dtype=torch.long, device=cache.device)]
            heads = _head_slice(rank.mesh, rank.place, name, cache.shape[2])
            mine[name] = (values if heads is None else values[:, heads]).to(cache.dtype)
        for name, values in mine.items():
            if name == "k":
                kv.write_kv(layer, values, mine["v"], slots)
            elif name != "v":
                kv.write(layer, name, values, slots)


def read_state(rank, request_id: str, wanted: dict) -> dict:
    """This GPU's head slice of the request's state at each wanted position, per
    linear layer it holds: {(position, layer): fields}."""
    out = {}
    for layer in rank.snapshots.layers:
        for pos, kind in wanted.items():
            state = (rank.linear.peek(layer, request_id, pos) if kind == "current"
                     else rank.linear.marked(layer, request_id, pos))
            if state is None:
                raise ValueError(f"GPU {rank.place.gpu} has no linear-attention state of "
                                 f"{request_id} after {pos} tokens in layer {layer}")
            out[pos, layer] = state
    return out


def read_snapshot(rank, key: int, position: int) -> dict:
    """This GPU's head slice of snapshot `key`, per linear layer it holds:
    {(position, layer): fields}."""
    copies = rank.snapshots.copies(key) if rank.snapshots.layers else {}
    if copies is None:
        raise ValueError(f"GPU {rank.place.gpu} has no linear-attention snapshot {key} "
                         f"(a prefix of {position} tokens) to send")
    return {(position, layer): state for layer, state in copies.items()}


def write_state(rank, request_id: str, position: int, data: dict, tp: int) -> None:
    """Cut this GPU's heads out of whole states and make them the request's."""
    index = rank.place.tp_index
    for pos, layers in data.items():
        for layer in rank.snapshots.layers:
            whole = layers[layer]
            mine = type(whole)(*(None if t is None else t.chunk(tp, dim=_HEAD_DIM[f])[index].clone()
                                 for f, t in enumerate(whole)))
            if pos == position:
                rank.linear.restore(layer, request_id, pos, mine)
            else:
                rank.linear.mark(layer, request_id, pos, mine)


# KDAState fields: conv_q, conv_k, conv_v `[K-1, heads * dk]` (heads are column blocks),
# recurrent `[heads, dk, dv]`
_HEAD_DIM = (1, 1, 1, 0)


# ---------------------------------------------------------------- internals
def _selected(kv, layers):
    """The (layer, caches) a GPU holds, of `layers` only if given."""
    return [(i, named) for i, named in kv.layers.items() if layers is None or i in layers]


def _check_table(plane, dp_rank: int, blocks, num_tokens: int, start: int) -> np.ndarray:
    if not 0 <= dp_rank < plane.layout.dp:
        raise ValueError(f"DP rank {dp_rank} does not exist (layout {plane.layout.text!r} "
                         f"has {plane.layout.dp})")
    if not 0 <= start <= num_tokens:
        raise ValueError(f"positions start={start}..num_tokens={num_tokens} are not a range "
                         f"(need 0 <= start <= num_tokens)")
    table = np.asarray(blocks, dtype=np.int64).reshape(-1)
    needed = -(-num_tokens // plane.block_size)
    if len(table) < needed:
        raise ValueError(f"{len(table)} blocks of {plane.block_size} tokens cannot hold "
                         f"{num_tokens} tokens (need {needed})")
    used = table[start // plane.block_size:needed]
    if len(used) and (used.min() < 0 or used.max() >= plane.num_blocks):
        raise ValueError(f"block ids {used.tolist()} outside the pool of "
                         f"{plane.num_blocks} blocks")
    return table


def _owned_slots(kv, positions: np.ndarray, table: np.ndarray, block_size: int):
    """Which of `positions` this GPU owns (their rows) and their physical slots."""
    rows = np.nonzero(kv.owned(positions))[0]
    mine = positions[rows]
    return rows, kv.slots(mine, table[mine // block_size])


def _read(cache: torch.Tensor, slots: np.ndarray, local_block_size: int) -> torch.Tensor:
    s = torch.as_tensor(slots, dtype=torch.long, device=cache.device)
    return cache[s // local_block_size, s % local_block_size]


def _head_dims(name: str) -> int:
    return 1 if name in ("k", "v") else 0


def _logical_shape(spec, per_token) -> tuple[int, ...]:
    """One position's logical shape, from the shape a GPU holds of it."""
    per_token = tuple(per_token)
    if len(per_token) == 2:  # GQA k / v: [heads_here, head_dim] -> all KV heads
        return (spec.num_kv_heads, per_token[1])
    return per_token


def _head_slice(mesh, place, name: str, here: int) -> slice | None:
    """The KV heads GPU `place` holds (`here` of them) among all of the model's."""
    if not _head_dims(name):
        return None
    first = mesh.heads_class(place.tp_index) * here
    return slice(first, first + here)


def _attention_layers(plane) -> list[int]:
    spec = plane.spec
    return [i for i in range(spec.num_layers) if not spec.is_linear_layer(i)]


def _check_coverage(plane, dp_rank, out: KVData, covered, start: int, layers=None) -> None:
    where = f"DP rank {dp_rank} of layout {plane.layout.text!r}"
    expected = set(_attention_layers(plane)) if layers is None else set(layers)
    missing_layers = sorted(expected - set(out))
    if missing_layers:
        raise ValueError(f"no GPU of {where} holds KV of layers {missing_layers}")
    for (layer, name), mask in covered.items():
        if not bool(mask.all()):
            holes = (~mask).nonzero()
            pos = sorted({int(p) + start for p in holes[:, 0]})
            what = f"positions {pos[:8]}{'...' if len(pos) > 8 else ''}"
            if mask.dim() > 1:
                what += f", heads {sorted({int(h) for h in holes[:, 1]})}"
            raise ValueError(f"layer {layer} {name!r}: no GPU of {where} holds {what}")


def _num_positions(data: KVData) -> int:
    sizes = {t.shape[0] for named in data.values() for t in named.values()}
    if len(sizes) > 1:
        raise ValueError(f"KV tensors disagree on the number of positions: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _check_data(rank, data: KVData, layers=None) -> None:
    """`data` holds every layer and cache tensor this GPU needs, logically shaped."""
    for layer, named in _selected(rank.kv, layers):
        if layer not in data:
            raise ValueError(f"KV data has no layer {layer} (it has {sorted(data)})")
        for name, cache in named.items():
            t = data[layer].get(name)
            want = _logical_shape(rank.spec, cache.shape[2:])
            if t is None or tuple(t.shape[1:]) != want:
                got = "none" if t is None else list(t.shape)
                raise ValueError(f"layer {layer} {name!r}: expected [T, "
                                 f"{', '.join(map(str, want))}] KV, got {got}")
