"""The `http` reward (algorithms/ops.http_reward) against a real reward server on loopback: rows
POSTed in batches, scores read back in order, 5xx answers and timeouts retried, a 4xx answer or an
unreachable server an error naming the server, and a graph scoring through it (with the pool)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flowrl.algorithms.ops import http_reward
from flowrl.contract.data import Prompt


class Server:
    """A reward server: each response scores its length; ``fail`` answers 503 first, ``slow`` sleeps first."""

    def __init__(self, fail: int = 0, slow: float = 0.0, status: int = 200) -> None:
        self.bodies: list[dict] = []
        self.fail, self.slow, self.status = fail, slow, status
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                if owner.slow and len(owner.bodies) == 1:
                    time.sleep(owner.slow)
                if owner.fail > 0 or owner.status != 200:
                    owner.fail -= 1
                    self.send_response(503 if owner.status == 200 else owner.status)
                    self.end_headers()
                    self.wfile.write(b"try again")
                    return
                out = json.dumps({"scores": [len(r) for r in body["responses"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    s = Server(**getattr(request, "param", {}))
    yield s
    s.close()


PROMPTS = [Prompt(text=f"p{i}", answer=str(i), meta={"id": i}) for i in range(5)]
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee"]


def test_rows_go_in_batches_and_scores_come_back_in_order(server):
    scores, metrics = http_reward(PROMPTS, RESPONSES, None, url=server.url, batch_size=2)
    assert scores == [1.0, 2.0, 3.0, 4.0, 5.0] and metrics == {"requests": 3, "retried": 0}
    assert [len(b["responses"]) for b in server.bodies] == [2, 2, 1]
    assert server.bodies[0] == {"prompts": ["p0", "p1"], "answers": ["0", "1"], "meta": [{"id": 0}, {"id": 1}],
                                "responses": ["a", "bb"]}  # fmt: skip


@pytest.mark.parametrize("server", [{"fail": 2}], indirect=True)
def test_a_5xx_answer_is_retried(server):
    scores, metrics = http_reward(PROMPTS[:1], RESPONSES[:1], None, url=server.url, retries=3, backoff_s=0.01)
    assert scores == [1.0] and metrics == {"requests": 3, "retried": 2}


@pytest.mark.parametrize("server", [{"slow": 2.0}], indirect=True)
def test_a_request_past_its_timeout_is_retried(server):
    scores, metrics = http_reward(PROMPTS[:1], RESPONSES[:1], None, url=server.url, timeout_s=0.3, backoff_s=0.01)
    assert scores == [1.0] and metrics["retried"] == 1


@pytest.mark.parametrize("server", [{"status": 422}], indirect=True)
def test_a_4xx_answer_is_an_error_at_once_naming_the_server(server):
    with pytest.raises(RuntimeError, match=r"answered 422 .*try again"):
        http_reward(PROMPTS[:1], RESPONSES[:1], None, url=server.url, retries=3, backoff_s=0.01)
    assert len(server.bodies) == 1


def test_an_unreachable_server_is_an_error_after_its_retries():
    dead = Server()
    url = dead.url
    dead.close()
    with pytest.raises(RuntimeError, match="unreachable after 2 tries"):
        http_reward(PROMPTS[:1], RESPONSES[:1], None, url=url, retries=1, backoff_s=0.01)
    with pytest.raises(ValueError, match="needs url="):
        http_reward(PROMPTS[:1], RESPONSES[:1], None)


GRAPH = """
from flowrl.graph import Graph


def build(cfg):
    g = Graph("remote")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="http", reads="prompts responses", writes="rewards", url=URL, batch_size=4)
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


@pytest.mark.slow
def test_a_graph_scores_through_a_reward_server_from_the_pools_workers(server, tmp_path):
    from flowrl import api

    src = tmp_path / "remote.py"
    src.write_text(f"URL = {server.url!r}\n" + GRAPH)
    small = ["steps=2", "rollout.prompts_per_step=4", "progress=false", "checkpoint=false", f"out={tmp_path}"]
    graph, plan = api.plan(str(src), overrides=[*small, "reward.workers=2", "reward.rows_per_call=4"], emit=None)
    metrics = api.run(graph, plan).metrics
    assert [m["reward/requests"] for m in metrics] == [2, 2] and all(m["reward/errors"] == 0 for m in metrics)
    assert len(server.bodies) == 4 and all(len(b["responses"]) == 4 for b in server.bodies)
