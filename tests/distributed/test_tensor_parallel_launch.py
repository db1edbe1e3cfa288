"""Tensor parallelism from the command line and over HTTP (Gloo, one thread per rank): torchrun
starting two ranks of `kvserve generate --tensor-parallel-size 2` prints what one process
prints, and the OpenAI server over an engine of two ranks answers as one of one rank does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve
from kvserve.distributed import free_port

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-target"
PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed"]
GENERATE = ["generate", "--model", str(MODEL), "--prompt", "First Citizen: We are accounted poor",
            "--max-tokens", "40", "--temperature", "0", "--dtype", "float32"]


def _text(completed: subprocess.CompletedProcess) -> str:
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout.rsplit("\n[", 1)[0]  # the text, without the metrics line


def test_torchrun_runs_the_ranks_of_one_command():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    alone = subprocess.run([sys.executable, "-m", "kvserve", *GENERATE], env=env,
                           capture_output=True, text=True, timeout=120)
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "kvserve", *GENERATE,
         "--tensor-parallel-size", "2", "--distributed-timeout", "60"],
        env=env, capture_output=True, text=True, timeout=180)
    assert _text(launched) == _text(alone)
    assert len(_text(alone)) > 40


def test_torchrun_ranks_must_match_the_tensor_parallel_size():
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "kvserve", *GENERATE,
         "--tensor-parallel-size", "1"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120)
    assert launched.returncode != 0
    assert "torchrun started" in launched.stderr


def test_the_server_answers_at_two_ranks_as_at_one():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from kvserve.async_engine import AsyncLLMEngine
    from kvserve.server import ServerState
    from kvserve.server.serve import BackgroundServer

    offline = kvserve.LLM(MODEL, dtype="float32", max_model_len=256)
    params = kvserve.SamplingParams(temperature=0, max_tokens=16)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    with AsyncLLMEngine(MODEL, dtype="float32", max_model_len=256, num_blocks=64,
                        tensor_parallel_size=2, distributed_timeout=60.0) as engine:
        state = ServerState("shakespeare")
        state.ready(engine, None)
        with BackgroundServer(state) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                   max_retries=0)
            got = [client.completions.create(model="shakespeare", prompt=p, temperature=0,
                                             max_tokens=16).choices[0].text for p in PROMPTS]
        workers = engine.engine.ranks.processes
    assert got == want
    assert [p.exitcode for p in workers] == [0]
