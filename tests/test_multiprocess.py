"""Two processes x 4 CPU devices (jax.distributed on localhost) restore element-distinct
parameters into their shards and decode exactly what one process decodes, whatever the device
order of the mesh; a job that loses a process ends at once. (Serving from two processes:
tests/test_serving.py::test_two_processes_serve_like_one.)"""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest

from k3text.checkpoint import load_model, save_model
from k3text.config import load_config
from k3text.inference.engine import Engine

from helpers import MODELS, ROOT, assert_same_greedy, coordinator_port, mesh_context
from serving import SHIPPED, Server

PROMPTS = [[5, 6, 7, 8], list(range(3, 40)), [9]]
MESH = ["ici_tensor_parallelism=2", "ici_expert_parallelism=4"]
DECODE = ["max_decode_steps=6", "ignore_eos=true", "matmul_precision=highest"]

_WORKER = """
import json, sys
import jax
import numpy as np
from jax.sharding import Mesh
from k3text import sharding
from k3text.checkpoint import load_model
from k3text.config import load_config
from k3text.inference.engine import Engine

model_file, ckpt, port, rank, order, prompts, *overrides = sys.argv[1:]
cfg = load_config(model_file, [f"load_parameters_path={ckpt}", "jax_distributed_initialize=true",
                               f"coordinator_address=localhost:{port}", "num_processes=2",
                               f"process_id={rank}", *overrides])
sharding.maybe_initialize_distributed(cfg)
devices = [jax.devices()[int(i)] for i in order.split(",")]
mesh = Mesh(np.asarray(devices).reshape([cfg.mesh_shape[a] for a in sharding.MESH_AXES]),
            sharding.MESH_AXES)
ctx = sharding.MeshContext(mesh, cfg.logical_axis_rules)
gen = Engine(cfg, load_model(cfg, ctx, ckpt), ctx).decode_batch(json.loads(prompts))
print("RESULT", json.dumps({"ids": gen.output_ids, "logprobs": gen.output_logprobs}))
"""


def element_distinct(cfg):
    """Parameters whose every element is a function of its own flat index (hashed), so any
    misplaced slice changes the model, while keeping fan-in-scaled magnitudes."""
    from k3text.checkpoint import hf

    values = {}
    for n, (path, shape) in enumerate(hf.abstract_params(cfg).items()):
        index = np.arange(int(np.prod(shape.shape)), dtype=np.float64).reshape(shape.shape)
        uniform = np.modf(np.sin(index * 12.9898 + n * 78.233) * 43758.5453)[0] % 1.0
        key = tuple(str(p) for p in path)
        if shape.dtype == np.uint8:
            packed = np.floor(uniform * 256).astype(np.uint8)
            values[key] = packed if key[-1].endswith("_packed") else np.full(shape.shape, 120,
                                                                              np.uint8)
        else:
            fan_in = shape.shape[-2] if len(shape.shape) > 1 else 1
            scale = 1.0 if len(shape.shape) == 1 or key[-1] == "table" else fan_in**-0.5
            normal = (uniform - 0.5) * np.sqrt(12.0) * scale
            values[key] = (1.0 + 0.1 * normal if len(shape.shape) == 1 else normal).astype(
                shape.dtype)
    return values


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = load_config(MODELS / "k3-tiny.yml")
    path = tmp_path_factory.mktemp("ckpt") / "k3-tiny"
    save_model(cfg, element_distinct(cfg), path)
    one = load_config(MODELS / "k3-tiny.yml", [f"load_parameters_path={path}", *MESH, *DECODE])
    ctx = mesh_context(one)
    expected = Engine(one, load_model(one, ctx, path), ctx).decode_batch(PROMPTS, top_n=2)
    return path, expected


def run_two_processes(path, order):
    port = coordinator_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                                      "--xla_backend_optimization_level=0"}
    workers = [subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(MODELS / "k3-tiny.yml"), str(path), str(port),
         str(rank), order, json.dumps(PROMPTS), *MESH, *DECODE],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [w.communicate(timeout=600) for w in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
    results = [json.loads(next(line for line in out.splitlines()
                               if line.startswith("RESULT"))[len("RESULT "):])
               for out, _ in outputs]
    assert results[0] == results[1]
    return results[0]


@pytest.mark.slow
@pytest.mark.parametrize("order", ["0,1,2,3,4,5,6,7", "5,2,7,0,3,6,1,4"])
def test_two_processes_decode_like_one(checkpoint, order):
    path, expected = checkpoint
    got = run_two_processes(path, order)
    # Same tokens; log-probabilities to float32 accuracy through six steps of a model whose
    # reductions (cross-process psums, the workers' unoptimised build) run in another order.
    assert_same_greedy(got["ids"], expected.output_ids, expected.output_top_logprobs,
                       got["logprobs"], expected.output_logprobs, atol=1e-3)


@pytest.mark.slow
def test_a_multi_process_server_stops_at_once_when_a_process_is_lost():
    """2 processes x 4 CPU devices, and the two ways a job loses one of them. Each side ends
    within seconds with one line (before, jax.distributed's exit handler waited for the lost
    process until its heartbeat aborted the survivor, status 134, over a minute later):
    - process 0 cannot take its port: it exits 2 naming the keys, and the follower does not
      outlive it (jax's coordination service, gone with process 0, ends it);
    - the follower is killed while the server is up: process 0 fails the request that finds
      it gone with a 500 whose message says so, and exits 1, naming what happened."""
    path = str(ROOT / "configs" / "inference" / "cpu8-local.yml")

    def distributed():
        return ["jax_distributed_initialize=true", "num_processes=2",
                f"coordinator_address=localhost:{coordinator_port()}"]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        job = distributed()
        follower = Server(path, *SHIPPED, *job, "process_id=1", listens=False)
        server = Server(path, *SHIPPED, *job, "process_id=0",
                        f"server_port={taken.getsockname()[1]}", listens=False)
        try:
            assert server.proc.wait(60) == 2, "\n".join(server.lines)
            assert follower.proc.wait(60) != 0, "\n".join(follower.lines)
            server.stop()
            assert server.lines[-1].startswith("error: cannot listen on"), server.lines
        finally:
            server.stop(signal.SIGKILL)
            follower.stop(signal.SIGKILL)

    job = distributed()
    follower = Server(path, *SHIPPED, *job, "process_id=1", listens=False)
    server = None
    try:
        server = Server(path, *SHIPPED, *job, "process_id=0")
        follower.stop(signal.SIGKILL)
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "k3-small", "prompt": [1, 5, 6], "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error", r.text
        assert "another process of this jax.distributed job stopped" in \
            r.json()["error"]["message"], r.text
        assert server.proc.wait(60) == 1, "\n".join(server.lines)
        server.stop()
        assert re.match(r"error: multi-process serving stopped at engine call \w+: another "
                        r"process of this jax.distributed job stopped", server.lines[-1]), \
            server.lines[-1]
    finally:
        if server is not None:
            server.stop(signal.SIGKILL)
        follower.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_multi_process_server_exits_when_a_process_is_stuck():
    """2 processes x 4 CPU devices, and a follower that is alive but stuck (stopped with
    SIGSTOP: jax's collectives wait for it for ever, and its heartbeat only lapses minutes
    later): the request's decode call waits in a collective, the watchdog finds the iteration
    past `serve_iteration_timeout`, and process 0 exits 1 naming it, for the platform to
    restart the job."""
    path = str(ROOT / "configs" / "inference" / "cpu8-local.yml")
    job = ["jax_distributed_initialize=true", "num_processes=2",
           f"coordinator_address=localhost:{coordinator_port()}", "serve_iteration_timeout=5"]
    follower = Server(path, *SHIPPED, *job, "process_id=1", listens=False)
    server = None
    try:
        server = Server(path, *SHIPPED, *job, "process_id=0")
        follower.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(httpx.TransportError):  # the connection ends with the process
            httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"model": "k3-small", "prompt": [1, 5, 6], "max_tokens": 4})
        assert server.proc.wait(60) == 1, "\n".join(server.lines)
        server.stop()
        assert re.match(r"error: a scheduler iteration has run \d+ s, past "
                        r"serve_iteration_timeout: a device, or another process of this job, is "
                        r"stuck", server.lines[-1]), server.lines[-1]
    finally:
        if server is not None:
            server.stop(signal.SIGKILL)
        follower.stop(signal.SIGKILL)

