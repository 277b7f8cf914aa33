"""Each process of a multi-GPU engine reads only its GPU's share of a checkpoint.

A Hugging Face checkpoint saved in several shard files (with its
model.safetensors.index.json) is read two ways: whole (`load_safetensors`, what the
threads executor does once for all its ranks) and piece by piece (`CheckpointReader`,
what each mp process does for its own GPU). For TP, EP and PP layouts the rank built
from the pieces holds exactly the tensors of the rank cut from the whole weights, bit
for bit, and the bytes it read are exactly the bytes of what it holds (no other
stage's layer, no other expert, no other TP slice was read). Under executor='mp' the
same holds in every worker process, and the tokens are the threads run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from compute_cases import (
    compute_engine, logits_by_row, outputs, run_to_end, shared_prefix_prompts, submit_prompts)
from hf_oracle import build_hf

from labkit.engine.compute.executors import checkpoint_reads
from labkit.engine.compute.mesh import Mesh
from labkit.engine.compute.models import load_safetensors
from labkit.engine.compute.models.checkpoint import READS, CheckpointReader
from labkit.engine.compute.models.sharding import tp_part
from labkit.engine.compute.rank_weights import rank_weights
from labkit.specs import Layout, get_model

pytest.importorskip("transformers")

_saved: dict = {}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """`family`'s tiny HF model saved in shard files of at most 100 KB."""
    def folder(family: str):
        if family not in _saved:
            path = tmp_path_factory.mktemp(f"sharded-{family}")
            build_hf(family).save_pretrained(path, max_shard_size="100KB")
            assert len(list(path.glob("*.safetensors"))) > 1
            assert (path / "model.safetensors.index.json").is_file()
            _saved[family] = path
        return _saved[family]
    return folder


def held_bytes(spec, weights: dict, place, layout) -> int:
    """Bytes of the tensors a rank holds, less the zero biases it makes without reading
    (a partial sum's bias lives whole on TP rank 0 only)."""
    total = 0
    for layer, named in weights.items():
        for name, t in named.items():
            full = f"model.layers.{layer}.{name}"
            tp_sliced = layer != "model" and not (layout.ep > 1 and ".mlp.experts." in full)
            if tp_sliced and tp_part(spec, full, t.shape, place.tp_index, layout.tp).zeros:
                continue
            total += t.numel() * t.element_size()
    return total


def reads_of(spec, folder, place, layout):
    READS.reset()
    mine = rank_weights(spec, CheckpointReader(folder, spec, torch.float32, verify=False),
                        place, layout)
    return mine, READS.bytes, set(READS.names)


@pytest.mark.parametrize("family,layout", [
    ("qwen3-moe", "tp2"), ("qwen3-moe", "dep2"), ("qwen3-moe", "pp2"),
    ("qwen3-moe", "tp2xep2"), ("llama", "tp4"), ("gpt-oss", "tp2"), ("gpt-oss", "dep2"),
    ("kimi-linear", "tp2")])
def test_a_gpus_pieces_equal_the_slices_of_the_whole_checkpoint(sharded, family, layout):
    folder = sharded(family)
    spec, lo = get_model(str(folder)), Layout.parse(layout)
    full = load_safetensors(folder, spec, torch.float32)
    whole = sum(t.numel() * t.element_size() for t in full.values())
    for place in Mesh(lo, spec).places:
        mine, nbytes, names = reads_of(spec, folder, place, lo)
        want = rank_weights(spec, full, place, lo)
        assert mine.keys() == want.keys()
        for layer in want:
            assert mine[layer].keys() == want[layer].keys()
            assert all(torch.equal(mine[layer][k], want[layer][k]) for k in want[layer])
        assert nbytes < whole
        if family != "gpt-oss":  # (its fused gate/up columns are read in pairs)
            assert nbytes == held_bytes(spec, want, place, lo)
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(place.layers)  # under PP, not one tensor of another stage
        if lo.ep > 1:
            experts = {int(n.split(".mlp.experts.")[1].split(".")[0])
                       for n in names if ".mlp.experts." in n}
            assert len(experts) == spec.num_experts // lo.ep


def scenario(folder, layout: str, executor: str):
    READS.reset()
    eng = compute_engine(str(folder), layout, checkpoint=str(folder), executor=executor,
                         block_size=16, max_num_batched_tokens=32)
    try:
        submit_prompts(eng, shared_prefix_prompts(eng.model.vocab_size), max_tokens=5)
        run_to_end(eng)
        gpus = list(range(eng.data_plane.mesh.world_size))
        reads = eng.data_plane.executor.run(checkpoint_reads, [()] * len(gpus), gpus)
        return eng, reads
    finally:
        eng.data_plane.close()


def test_worker_processes_read_only_their_shard(sharded):
    """tp2xpp2 under mp (4 processes): each process read exactly the bytes its GPU
    holds, none of the other stage's layers, and the tokens and logits are those of
    the threads executor (which reads the checkpoint whole)."""
    folder = sharded("llama")
    threads, _ = scenario(folder, "tp2xpp2", "threads")
    procs, reads = scenario(folder, "tp2xpp2", "mp")
    assert outputs(procs) == outputs(threads) and len(outputs(procs)) == 3
    a, b = logits_by_row(threads), logits_by_row(procs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    spec, lo = get_model(str(folder)), Layout.parse("tp2xpp2")
    for place, (nbytes, names) in zip(Mesh(lo, spec).places, reads):
        _, want_bytes, want_names = reads_of(spec, folder, place, lo)
        assert (nbytes, set(names)) == (want_bytes, want_names)
        assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} \
            == set(place.layers)
    assert not dist.is_initialized()
