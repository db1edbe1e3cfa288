"""Tensor parallelism from the command line and over HTTP (Gloo, one thread per rank): torchrun
starting two ranks of `kvserve generate --tensor-parallel-size 2` prints what one process
prints, `kvserve eval-ppl --tensor-parallel-size 2` the perplexity of one rank, and the OpenAI
server over an engine of two ranks answers as one of one rank does; a script whose spawned
workers die at start (no main guard) fails at once."""

from __future__ import annotations

import os
import re
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


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def alone() -> str:
    text = _text(subprocess.run([sys.executable, "-m", "kvserve", *GENERATE], env=ENV,
                                capture_output=True, text=True, timeout=120))
    assert len(text) > 40
    return text


def test_torchrun_runs_the_ranks_of_one_command(alone):
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "kvserve", *GENERATE,
         "--tensor-parallel-size", "2", "--distributed-timeout", "60"],
        env=ENV, capture_output=True, text=True, timeout=180)
    assert _text(launched) == alone


def test_torchrun_as_two_nodes_runs_one_command(alone):
    """Two torchrun launchers, one per node (--nnodes 2 --node-rank 0|1), meeting at node 0's
    address, as on two machines: rank 0 prints the text, rank 1 is its worker. (Both nodes are
    this machine: the rendezvous and the Gloo groups go over TCP as between machines.) With
    asynchronous scheduling: rank 1 is fed each step's tokens over the device group."""
    port = str(free_port())

    def node(rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr",
                "127.0.0.1", "--master-port", port, "-m", "kvserve", *GENERATE,
                "--tensor-parallel-size", "2", "--distributed-timeout", "60",
                "--async-scheduling"]

    worker = subprocess.Popen(node(1), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        launched = subprocess.run(node(0), env=ENV, capture_output=True, text=True, timeout=180)
        out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-2000:]
    assert _text(launched) == alone and out == ""


def test_eval_ppl_at_two_ranks_prints_what_one_rank_prints(tmp_path):
    """The engine scores every window's prompt over both ranks (it starts rank 1 itself)."""
    text = tmp_path / "text.txt"
    text.write_text("ROMEO:\nBut, soft! what light through yonder window breaks?\n"
                    "It is the east, and Juliet is the sun.\n" * 8)
    command = [sys.executable, "-m", "kvserve", "eval-ppl", "--model", str(MODEL), "--text",
               str(text), "--max-length", "96", "--stride", "40", "--dtype", "float32",
               "--max-model-len", "128"]
    one, two = (subprocess.run(command + extra, env=ENV, capture_output=True, text=True,
                               timeout=180)
                for extra in ([], ["--tensor-parallel-size", "2", "--distributed-timeout", "60"]))
    figures = []
    for completed in (one, two):
        assert completed.returncode == 0, completed.stderr[-2000:]
        figures.append(re.match(r"perplexity (\S+) .* over (\S+) tokens", completed.stdout))
    assert "2 ranks" in two.stdout and figures[0][2] == figures[1][2]
    assert float(figures[1][1]) == pytest.approx(float(figures[0][1]), rel=1e-4)


def test_torchrun_ranks_must_match_the_tensor_parallel_size():
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "kvserve", *GENERATE,
         "--tensor-parallel-size", "1"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120)
    assert launched.returncode != 0
    assert "torchrun started" in launched.stderr


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_server_answers_at_two_ranks_as_at_one(async_scheduling):
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
                        tensor_parallel_size=2, distributed_timeout=60.0,
                        async_scheduling=async_scheduling) as engine:
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


def test_a_script_without_a_main_guard_fails_at_once(tmp_path):
    """Spawned workers re-import the script that made the engine; one without `if __name__ ==
    "__main__":` makes each worker die at start. Rank 0 says so at once instead of waiting out
    the rendezvous (distributed_timeout, 600 s by default)."""
    script = tmp_path / "unguarded.py"
    script.write_text("import kvserve\n"
                      f"kvserve.LLM({str(MODEL)!r}, tensor_parallel_size=2, "
                      "distributed_backend='gloo')\n")
    done = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "exited (code 1) before it started" in done.stderr, done.stderr[-2000:]
    assert '`if __name__ == "__main__":`' in done.stderr
