"""ZeRO's shard index (plait/parallel/zero_index.py): every element of every parameter and
state held exactly once over the dp ranks, padding never, and what the entries read is the
optimizer's state (full_state, and an all-gather of the moments written here)."""

from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from helpers import batches_for, config, token_file

from plait.launch.forked import run_ranks
from plait.mesh import ParallelMesh
from plait.train.loop import full_state, train

MOMENTS = ("exp_avg", "exp_avg_sq")
COMBOS = [(stage, precision, kind) for stage in (1, 2, 3) for precision in ("fp32", "bf16")
          for kind in ("adamw", "sgd")]


def _sets(dp: int, stage: int, precision: str, kind: str, *extra: str) -> list[str]:
    sets = [f"parallel.dp={dp}", f"parallel.zero={stage}", f"train.precision={precision}",
            "train.steps=1", *extra]
    if kind == "sgd":
        sets += ["train.optimizer=sgd", "train.weight_decay=0"]
    if dp == 3:
        sets.append("train.global_batch=6")
    return sets


def _probe(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    """One training step of each run on these ranks (one mesh per layout, reused: a rank's
    first step is most of the time); what the index says and reads after it."""
    meshes, out = {}, []
    for sets in runs:
        cfg = config(*sets).check(world)
        key = tuple(getattr(cfg.parallel, d) for d in ("dp", "tp", "pp"))
        if key not in meshes:
            meshes[key] = ParallelMesh.build(cfg.parallel)
        mesh = meshes[key]
        result = train(cfg, mesh, batches_for(cfg))
        out.append(_read(result, mesh))
    return out


def _read(result, mesh: ParallelMesh) -> dict:
    opt, model = result.optimizer, result.model
    names = getattr(model, "model_names", {})
    local = {names.get(n, n): p for n, p in model.named_parameters()}
    index = opt.shard_index()
    return {
        "group": (mesh.coord("tp"), mesh.coord("pp")), "dp": mesh.coord("dp"),
        "index": index, "layouts": [opt.shard_index(r) for r in range(mesh.size("dp"))],
        "pieces": [opt.shard_view(e).clone() for e in index],
        "shapes": {n: (tuple(p.shape), p.dtype) for n, p in local.items()},
        # stages 1, 2 hold the whole parameter too: a second source for `param`
        "params": {n: p.detach().clone() for n, p in local.items()} if opt.stage < 3 else None,
        "full": full_state(model, opt),  # fp32 masters gathered over dp; tp-local
        "moments": _gathered_moments(opt, mesh, names),
        "padding": sum(u.k * opt.n - u.numel for u in opt.units),
        "flat_shards": all(result.placements.of(p).flat_shard is not None
                           for p in local.values()),
    }


def _gathered_moments(opt, mesh: ParallelMesh, names: dict) -> dict:
    """Each unit's moment shards all-gathered over dp and cut at the parameters' sizes."""
    out = {}
    for state in MOMENTS:
        if state not in opt.states:
            continue
        out[state] = {}
        for u in opt.units:
            shard = getattr(u, state)
            parts = [torch.empty_like(shard) for _ in range(mesh.size("dp"))]
            dist.all_gather(parts, shard, group=mesh.group("dp"))
            flat, at = torch.cat(parts), 0
            for name, p in zip(u.names, u.params, strict=True):
                out[state][names.get(name, name)] = flat[at:at + p.numel()].view(p.shape)
                at += p.numel()
    return out


def _check(outs: list[dict], what: str) -> dict:
    """Assemble each dp group's entries into full tensors; returns the groups' shapes."""
    groups = defaultdict(list)
    for o in outs:
        groups[o["group"]].append(o)
    shapes_by_group = {}
    for group, members in groups.items():
        first = members[0]
        shapes, full = first["shapes"], first["full"]
        assert first["flat_shards"], what
        assert set(shapes) == set(full), what  # the index's names are full_state's keys
        states = ("param", "master", *first["moments"])
        assert {e.state for m in members for e in m["index"]} == set(states), what
        cover = {(n, s): torch.zeros(sh.numel(), dtype=torch.int32)
                 for n, (sh, _) in _sizes(shapes).items() for s in states}
        value = {(n, s): torch.zeros(sh.numel(), dtype=dt if s == "param" else torch.float32)
                 for n, (sh, dt) in _sizes(shapes).items() for s in states}
        for m in members:
            assert m["layouts"] == first["layouts"], what  # every rank agrees on every layout
            assert m["layouts"][m["dp"]] == m["index"], what
            for e, t in zip(m["index"], m["pieces"], strict=True):
                assert e.dp_rank == m["dp"] and e.shape == shapes[e.name][0], (what, e)
                assert 0 <= e.start < e.stop <= torch.Size(e.shape).numel(), (what, e)
                assert t.dtype == e.dtype and t.numel() == e.numel, (what, e)
                if e.rows is not None:
                    assert t.view(e.view_shape()).shape[1:] == e.shape[1:]
                cover[e.name, e.state][e.start:e.stop] += 1
                value[e.name, e.state][e.start:e.stop] = t
        for key, c in cover.items():  # (a) every element exactly once, padding never
            assert bool((c == 1).all()), (what, group, key, int(c.min()), int(c.max()))
        for n, (shape, dtype) in shapes.items():  # (b) the views are the state
            assert torch.equal(value[n, "master"].view(shape), full[n]), (what, n)
            assert torch.equal(value[n, "param"].view(shape), full[n].to(dtype)), (what, n)
            if first["params"] is not None:
                assert torch.equal(value[n, "param"].view(shape), first["params"][n])
            for s in first["moments"]:
                assert torch.equal(value[n, s].view(shape), first["moments"][s][n]), (what, n)
        shapes_by_group[group] = shapes
    return shapes_by_group


def _sizes(shapes: dict) -> dict:
    return {n: (torch.Size(sh), dt) for n, (sh, dt) in shapes.items()}


@pytest.mark.parametrize("dp", [2, 3])
def test_index_covers_each_element_once_and_reads_the_state(dp):
    """Stages 1-3 x fp32/bf16 x AdamW/SGD (1, 2: a unit of several modules); dp=3 pads the
    units (padding must not appear)
    and has a middle rank, so dp=2 and 3 hold every case dp=4 would (the checkpoint round
    trips of tests/test_matrix.py read the index at dp=4)."""
    token_file()  # made once in the parent, before the ranks fork
    runs = [_sets(dp, *combo) for combo in COMBOS]
    outs = run_ranks(_probe, dp, runs)
    for i, combo in enumerate(COMBOS):
        _check([o[i] for o in outs], f"dp={dp} zero/precision/optimizer={combo}")
    if dp == 3:  # stage 3's units, one per module, are padded (1 and 2's may not be)
        stage3 = [i for i, combo in enumerate(COMBOS) if combo[0] == 3]
        assert all(o[i]["padding"] > 0 for o in outs for i in stage3)


def test_index_speaks_of_tp_local_tensors_and_the_models_names():
    """tp=2 x dp=2: ranges and shapes are the tp slices'; pp=2 x dp=2 (ZeRO-1): a pipeline
    rank's entries carry the model's names, and the two pp groups hold every parameter."""
    token_file()
    runs = [_sets(2, 1, "fp32", "adamw", "parallel.tp=2"),
            _sets(2, 3, "bf16", "adamw", "parallel.tp=2"),
            _sets(2, 1, "fp32", "adamw", "parallel.pp=2", "model.n_layers=4",
                  "parallel.microbatches=2")]
    outs = run_ranks(_probe, 4, runs)
    for i in (0, 1):
        _check([o[i] for o in outs], f"tp2 dp2 run {i}")
        split = [e for o in outs for e in o[i]["index"] if e.tp_local]
        assert split and all(e.shape != e.full_shape for e in split
                             if e.name.endswith(("wq.weight", "w1.weight")))
        assert all(e.splits[0].dim == "tp" for e in split)
        whole = [e for o in outs for e in o[i]["index"] if not e.tp_local]
        assert all(e.shape == e.full_shape for e in whole)
    by_group = _check([o[2] for o in outs], "pp2 dp2 zero1")
    names = [set(s) for s in by_group.values()]
    assert len(names) == 2 and not names[0] & names[1]
    from plait.model.transformer import build_model
    want = {n for n, _ in build_model(config("model.n_layers=4").model, seed=0,
                                      device="meta").named_parameters()}
    assert names[0] | names[1] == want
