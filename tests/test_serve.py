"""`jzero serve` as users meet it: the real server in its own process on a free loopback port,
called with a real HTTP client (aiohttp). Concurrent requests, streamed and whole, answer what
`jzero generate` prints for the same seed and settings; bad bodies get 400 / 413 / 422 naming
the field; SIGTERM finishes the request in flight, then the process exits 0."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jzero.cli import main
from jzero.models import gpt
from jzero.zero import treepath

pytestmark = pytest.mark.slow
CONFIG = '{"train_batch_size": 8, "jzero": {"model": {"size": "tiny"}}}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, process, config path, weights path): a tiny random GPT served with 4 slots."""
    folder = tmp_path_factory.mktemp("serve")
    config, weights = folder / "tiny.json", folder / "w.safetensors"
    config.write_text(CONFIG)
    params = jax.jit(gpt.make(gpt.GPTConfig())[0])(jax.random.key(0))
    save_file({k.replace("/", "."): np.asarray(v) for k, v in treepath.named_leaves(params).items()}, str(weights))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", "serve", str(config), "--checkpoint", str(weights),
                             "--port", str(port), "--slots", "4", "--max-tokens-limit", "40",
                             "--max-body-bytes", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
    yield url, proc, config, weights
    if proc.poll() is None:
        proc.kill()


async def _complete(session, url, body):
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if not body.get("stream"):
            return response.status, await response.json()
        chunks = []
        async for line in response.content:
            if line.startswith(b"data: "):
                chunks.append(line[6:].strip().decode())
        return response.status, chunks


def _generated(capsys, config, weights, body) -> str:
    """What `jzero generate` prints after the prompt for the body's prompt and settings."""
    args = ["generate", str(config), "--checkpoint", str(weights), "--prompt", body["prompt"],
            "--max-tokens", str(body["max_tokens"]), "--seed", str(body["seed"]),
            "--temperature", str(body.get("temperature", 1.0)), "--top-p", str(body.get("top_p", 1.0))]
    assert main(args) == 0
    return capsys.readouterr().out[len(body["prompt"]):-1]


def test_serve_answers_like_generate_rejects_bad_input_and_stops_on_sigterm(server, capsys):
    url, proc, config, weights = server
    bodies = [{"prompt": "def ", "max_tokens": 24, "seed": 5, "temperature": 0.8, "top_p": 0.9},
              {"prompt": "import os\n", "max_tokens": 20, "seed": 1, "temperature": 0.0, "stream": True},
              {"prompt": "class A", "max_tokens": 16, "seed": 2},
              {"prompt": "x = ", "max_tokens": 30, "seed": 3, "temperature": 0.5, "stream": True}]

    async def concurrent():
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/health") as health:
                assert health.status == 200 and (await health.json())["status"] == "ok"
            return await asyncio.gather(*(_complete(session, url, b) for b in bodies))

    answers = asyncio.run(concurrent())
    for body, (status, answer) in zip(bodies, answers, strict=True):
        assert status == 200
        if body.get("stream"):
            assert answer[-1] == "[DONE]"
            chunks = [json.loads(c)["choices"][0] for c in answer[:-1]]
            text, tokens = "".join(c["text"] for c in chunks), [t for c in chunks for t in c["token_ids"]]
            finish = chunks[-1]["finish_reason"]
        else:
            choice = answer["choices"][0]
            text, tokens, finish = choice["text"], choice["token_ids"], choice["finish_reason"]
            assert answer["usage"]["completion_tokens"] == body["max_tokens"] and answer["seed"] == body["seed"]
        assert len(tokens) == body["max_tokens"] and finish == "length"
        assert text == _generated(capsys, config, weights, body), body

    async def bad_requests():
        async with aiohttp.ClientSession() as session:
            async def post(data):
                async with session.post(f"{url}/v1/completions", data=data,
                                        headers={"Content-Type": "application/json"}) as response:
                    return response.status, (await response.json())["error"]["message"]
            return [await post(b"{not json"), await post(json.dumps({"prompt": "a", "max_tokens": -1})),
                    await post(json.dumps({"prompt": "a" * 65, "max_tokens": 4})),
                    await post(json.dumps({"prompt": "a", "max_tokens": 41})),
                    await post(json.dumps({"prompt": "a", "max_tokens": 4, "top_p": "high"})),
                    await post(json.dumps({"prompt": "a" * 5000}))]

    errors = asyncio.run(bad_requests())
    assert [status for status, _ in errors] == [400, 422, 422, 422, 422, 413]
    assert errors[0][1].startswith("body: not valid JSON")
    assert errors[1][1] == "max_tokens: must be in 1..40, got -1"
    assert errors[2][1] == "prompt: 1 to 64 tokens (the model's context), got 65"
    assert errors[4][1] == 'top_p: expected a number, got "high"'

    async def in_flight_then_sigterm():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "def ", "max_tokens": 40, "seed": 7, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                first = await response.content.readline()
                proc.send_signal(signal.SIGTERM)
                rest = [line async for line in response.content if line.startswith(b"data: ")]
            return first, rest

    first, rest = asyncio.run(in_flight_then_sigterm())
    assert first.startswith(b"data: ") and rest[-1] == b"data: [DONE]\n"
    assert len(rest) == 40  # the 39 tokens after the first, then [DONE]: finished, not cut
    assert proc.wait(timeout=60) == 0
    out = proc.stdout.read()
    assert "jzero: serve stopped cleanly" in out
    assert "jzero: serve compiled 4 programs" in out  # prefill (prompts fit one bucket), insert, generate, retire
