"""What `plait train` says about what is happening: the starting weights it reads, a
compiled run's slow first step, how far a stopped run got (numbered as the step lines
number steps), and the layout line's settings (async-TP, cp mode, compile)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from helpers import token_file
from test_eval_model_flag import _save_tiny

from plait.checkpoint import Checkpointing
from plait.checkpoint.export import write_safetensors
from plait.checkpoint.hf import model_config, weight_names
from plait.checkpoint.init_from import describe_initial
from plait.cli.rank import _say_start, _who
from plait.config import load_config
from plait.launch.forked import run_ranks
from plait.train.loop import run_layout
from plait.train.progress import steps_done_text

HF = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 40,
      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
      "max_position_embeddings": 64}


def _hf_dir(d: Path) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF))
    shapes = dict(weight_names(model_config(d)).values())
    write_safetensors(d / "model.safetensors", shapes, lambda n: torch.zeros(shapes[n]),
                      "fp32", {"format": "pt"})
    return d


def test_starting_weights_are_named_with_their_tensors_and_step(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "llama")
    cfg = load_config(sets=[f"train.init_from=hf:{hf}"])
    cfg.model = model_config(hf)
    _say_start(cfg, Checkpointing())
    out = capsys.readouterr().out
    # 1 layer: 9 tensors a block, the embedding, the final norm, the head
    assert f"plait: starting weights from hf:{hf}: 12 tensors (a Hugging Face model: no " \
           "training step recorded); the optimizer starts at step 0" in out, out
    ck = tmp_path / "ck"
    token_file()
    run_ranks(_save_tiny, 1, str(ck))
    text = describe_initial(str(ck), load_config().model)  # tiny: 2 layers of 9, and 3
    assert re.fullmatch(rf"{re.escape(str(ck))}/step-0+1: the masters of 21 tensors, saved "
                        r"after 1 step", text), text


def test_a_compiled_run_says_so_once_before_its_first_step(capsys):
    _say_start(load_config(sets=["train.compile=true"]), Checkpointing())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "compiling each transformer block (torch.compile, " \
        "inductor) during the first step" in lines[0]
    _say_start(load_config(), Checkpointing())
    assert capsys.readouterr().out == ""


def test_steps_done_are_numbered_as_the_step_lines():
    assert steps_done_text(57, 150) == "after step 56 (57 of 150 steps done)"
    assert steps_done_text(0, 150) == "before step 0 (none of 150 steps done)"
    replica = argparse.Namespace(replica="1:0:2")
    assert _who(replica) == "replica 1: " and _who(argparse.Namespace(replica=None)) == ""


def test_the_layout_line_names_async_tp_the_cp_mode_and_compile():
    mesh = SimpleNamespace(describe=lambda: "dp=1 x pp=1 x cp=2 x tp=2 (order innermost "
                           "first: tp,cp,pp,dp)")
    cfg = load_config(sets=["parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                            "parallel.async_tp=true", "parallel.cp_mode=allgather",
                            "train.compile=true"])
    assert run_layout(cfg, mesh) == ("dp=1 x pp=1 x cp=2 x tp=2, SP, async-TP, cp allgather, "
                                     "fp32, compiled (inductor) (order innermost first: "
                                     "tp,cp,pp,dp)")
    plain = load_config()
    assert run_layout(plain, SimpleNamespace(describe=lambda: "dp=1")) == "dp=1, fp32"
