"""kvserve workers behind vLLM's router (vllm-router, from PyPI), all on loopback: two replicas
serve a hundred mixed requests with the outputs of one server; in the router's prefill/decode
mode a producer and a consumer give the colocated outputs with the KV moved between them; a
producer that dies while its pages are awaited gives the client an error and frees the
consumer's blocks."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("vllm_router")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from kvserve.launch import Worker, router_command, wait_healthy  # noqa: E402
from kvserve.server.serve import free_port  # noqa: E402

pytestmark = pytest.mark.serial

MODEL = Path(__file__).resolve().parents[2] / "models" / "shakespeare-draft"
TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")
LINES = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "First Citizen:\nBefore we proceed any further",
         "KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not to be"]


def serve_args() -> list[str]:
    return ["--model", str(MODEL), "--max-model-len", "256", "--dtype", "float32",
            "--served-model-name", "m", "--chat-template", TEMPLATE, "--log-level", "warning"]


def start_worker(role: str) -> tuple[Worker, subprocess.Popen]:
    worker = Worker(free_port(), role)
    cmd = [sys.executable, "-m", "kvserve", "serve", *serve_args(), "--port", str(worker.port),
           "--threads", "1", "--kv-role", role, "--kv-transfer-timeout", "30"]
    process = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               stdout=subprocess.DEVNULL)
    return worker, process


def start_router(workers: list[Worker]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    process = subprocess.Popen(
        router_command(workers, "127.0.0.1", port, "round_robin",
                       ["--log-level", "warning", "--prometheus-port", str(free_port())]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, 60)
    return url, process


@pytest.fixture(scope="module")
def cluster():
    """`kvserve launch --prefill 1 --decode 1`: a producer, a consumer and the router in its
    prefill/decode mode; plus a router in its plain mode over the same two workers (which also
    serve requests without kv_transfer_params: they are replicas too)."""
    port, first = free_port(), free_port()
    while first + 1 == port:
        first = free_port()
    workers = [Worker(first, "producer"), Worker(first + 1, "consumer")]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "launch", "--prefill", "1", "--decode", "1",
         "--port", str(port), "--worker-port", str(first), "--router-policy", "round_robin",
         "--threads-per-worker", "1", "--", *serve_args(), "--kv-transfer-timeout", "30"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL)
    processes = [launcher]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", launcher, 180)
        replicas, router = start_router([Worker(w.port) for w in workers])
        processes.append(router)
        yield {"producer": workers[0].url, "consumer": workers[1].url, "replicas": replicas,
               "disaggregated": f"http://127.0.0.1:{port}"}
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(timeout=60)
    for w in workers:  # the launcher stopped its workers
        with pytest.raises(httpx.TransportError):
            httpx.get(w.url + "/health")


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    values: dict[str, float] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def mixed_requests(count: int, seed: int = 0) -> list[tuple[str, dict]]:
    """Completions and chats, greedy and seeded sampling, streamed or not."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        body = {"model": "m", "max_tokens": rng.randint(1, 12), "stream": rng.random() < 0.3}
        if rng.random() < 0.5:
            body.update(temperature=0.0)
        else:
            body.update(temperature=0.8, top_p=0.9, seed=i)
        if rng.random() < 0.6:
            out.append(("/v1/completions", {**body, "prompt": rng.choice(LINES) * rng.randint(1, 3)}))
        else:
            out.append(("/v1/chat/completions", {**body, "messages": [
                {"role": "user", "content": rng.choice(LINES)}]}))
    return out


async def answer(http, url: str, path: str, body: dict) -> str:
    """The generated text (streamed chunks joined)."""
    if not body["stream"]:
        r = await http.post(url + path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    text = []
    async with http.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    text.append(c.get("text") or c.get("delta", {}).get("content") or "")
    return "".join(text)


def answers(url: str, requests: list[tuple[str, dict]], concurrency: int = 8) -> list[str]:
    async def run():
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=120) as http:
            async def one(path, body):
                async with limit:
                    return await answer(http, url, path, body)
            return await asyncio.gather(*(one(p, b) for p, b in requests))
    return asyncio.run(run())


def successes(url: str) -> float:
    return scrape(url).get("kvserve:request_success_total", 0.0)


def test_two_replicas_serve_a_hundred_mixed_requests_as_one_server(cluster):
    requests = mixed_requests(100)
    before = [successes(cluster[k]) for k in ("producer", "consumer")]
    routed = answers(cluster["replicas"], requests)
    served = [successes(cluster[k]) - b for k, b in zip(("producer", "consumer"), before)]
    assert min(served) >= 40 and sum(served) == 100  # round robin: both replicas served
    assert routed == answers(cluster["producer"], requests)
    # The load that the router's power_of_two policy polls: nothing runs now.
    assert httpx.get(cluster["consumer"] + "/get_load").json()["load"] == 0


def test_disaggregated_outputs_equal_colocated(cluster):
    """Through the router's PD mode: the prefill on the producer, the decode on the consumer,
    which computes no prompt token for them (its loaded-token counter grows instead)."""
    requests = [(p, {**b, "temperature": 0.0}) for p, b in mixed_requests(12, seed=1)]
    before = scrape(cluster["consumer"])
    routed = answers(cluster["disaggregated"], requests, concurrency=4)
    after = scrape(cluster["consumer"])
    assert routed == answers(cluster["producer"], requests)
    assert after["kvserve:prompt_tokens_computed_total"] == \
        before["kvserve:prompt_tokens_computed_total"]
    assert after["kvserve:prompt_tokens_loaded_total"] > before["kvserve:prompt_tokens_loaded_total"]
    producer = scrape(cluster["producer"])
    assert producer["kvserve:kv_transfers_served_total"] >= 12
    assert producer["kvserve:num_requests_holding_kv"] == 0


def test_a_producer_that_dies_mid_transfer_fails_only_that_request(cluster):
    """The consumer waits on the pages of a producer that is frozen, then killed: the client
    gets an error long before the transfer timeout, the consumer's blocks are freed and it
    keeps serving."""
    worker, process = start_worker("producer")
    try:
        wait_healthy(worker.url, process, 120)
        body = {"model": "m", "prompt": LINES[2] * 3, "max_tokens": 8, "temperature": 0.0}
        for attempt in range(2):  # the first pull connects the pair; the second is cut
            prefill = httpx.post(worker.url + "/v1/completions", timeout=60, json={
                **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            params = prefill.json()["kv_transfer_params"]
            if attempt == 1:
                process.send_signal(signal.SIGSTOP)
                killer = asyncio.get_event_loop_policy().new_event_loop()
                started = time.monotonic()

                async def kill_later():
                    await asyncio.sleep(1.0)
                    process.kill()

                async def decode():
                    async with httpx.AsyncClient(timeout=60) as http:
                        return await asyncio.gather(http.post(
                            cluster["consumer"] + "/v1/completions",
                            json={**body, "kv_transfer_params": params}), kill_later())
                r = killer.run_until_complete(decode())[0]
                killer.close()
                assert r.status_code == 500 and "KV transfer" in r.json()["error"]["message"]
                assert time.monotonic() - started < 20  # not the 30 s transfer timeout
            else:
                r = httpx.post(cluster["consumer"] + "/v1/completions", timeout=60,
                               json={**body, "kv_transfer_params": params})
                assert r.status_code == 200
        metrics = scrape(cluster["consumer"])
        assert metrics["kvserve:num_requests_loading_kv"] == 0
        assert metrics["kvserve:kv_cache_usage_perc"] == 0
        r = httpx.post(cluster["consumer"] + "/v1/completions", timeout=60, json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.mark.parametrize("counts, match", [
    ((0, 0, 0), "give --replicas N"),
    ((2, 1, 1), "pick one"),
    ((0, 1, 0), "give --replicas N"),
    ((-1, 0, 0), "negative"),
])
def test_launch_refuses_a_plan_without_workers_or_with_both_kinds(counts, match):
    from kvserve.launch import plan_workers

    with pytest.raises(ValueError, match=match):
        plan_workers(*counts)


def test_launch_plans_ports_and_roles():
    from kvserve.launch import plan_workers

    workers = plan_workers(prefill=2, decode=1, first_port=9000)
    assert [(w.port, w.kv_role) for w in workers] == [
        (9000, "producer"), (9001, "producer"), (9002, "consumer")]
    cmd = router_command(workers, "0.0.0.0", 8000, "cache_aware")
    assert cmd[cmd.index("--vllm-pd-disaggregation"):] == [
        "--vllm-pd-disaggregation", "--prefill", workers[0].url, "--prefill", workers[1].url,
        "--decode", workers[2].url]
