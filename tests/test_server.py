"""server.py, the OpenAI-compatible server: the official `openai` client (and httpx for raw bodies) against one server
for the module, the default model on the CPU (eager, 8 rows of 256 positions), started on 127.0.0.1 on a free port
in a thread (uvicorn.Server; should_exit stops it). Every wait is bounded."""
import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

# (requirements-test.txt has them; the GPU machine's image lacks them)
httpx, openai, uvicorn = (pytest.importorskip(m, reason=f"{m} is a test requirement; the GPU image lacks it")
                          for m in ("httpx", "openai", "uvicorn"))
pytest.importorskip("fastapi", reason="fastapi is in requirements.txt; the GPU image lacks it")
import generate  # noqa: E402
import server  # noqa: E402
from common import Sampling
from generate import Generator
from quantize import load
from tokenizer import load_tokenizer

ROWS, WAITING, LENGTH = 8, 12, 256


def wait_until(condition, seconds=60.0, what="the condition"):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def health(url):
    try:
        return httpx.get(f"{url}/health", timeout=5)
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def served(default_ckpt):
    """(the Server, its URL, /health's answers while warming up and after). The warm-up waits for a gate, so that
    /health is asked while it runs."""
    srv = server.load(server.build_parser().parse_args(
        ["--checkpoint", str(default_ckpt), "--device", "cpu", "--max-batch", str(ROWS), "--max-waiting", str(WAITING),
         "--max-length", str(LENGTH)]))
    gate, warm_up = threading.Event(), srv.llm.warm_up
    srv.llm.warm_up = lambda progress=None: gate.wait(60) and warm_up(progress)
    sock = server.listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(srv.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    warming = wait_until(lambda: health(url), what="the server")
    gate.set()
    ready = wait_until(lambda: (r := health(url)) is not None and r.status_code == 200 and r, what="warm-up")
    yield srv, url, (warming, ready)
    uv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive() and not srv.engine.is_alive()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alone(default_ckpt):
    """generate.py's greedy run of one prompt on a model of its own: (ids, max_new_tokens) -> (text, tokens made)."""
    model = load(default_ckpt, device=torch.device("cpu"), dtype=torch.float32)
    tok = load_tokenizer(default_ckpt)
    gen, stop = Generator(model, Sampling(temperature=0), "eager"), set(tok.eos_ids)

    def run(ids, n):
        tokens = [t for chunk in gen.generate([ids], n, stop) for t in chunk[0]]
        return generate.stream(gen, tok, ids, n, stop), len(tokens)
    run.model, run.tok = model, tok
    return run


def test_health_is_503_while_warming_up_then_200(served):
    warming, ready = served[2]
    assert warming.status_code == 503 and set(warming.json()["error"]) == {"message", "type", "param", "code"}
    assert ready.status_code == 200


def test_models_lists_the_checkpoint(served, client, default_ckpt):
    assert [m.id for m in client.models.list().data] == [default_ckpt.name] == [served[0].name]


def ask(client, chat: bool, prompt: str, stream: bool = False, **kw) -> tuple[list[str], object]:
    """A completion or a chat completion -> (each choice's text, joined from its chunks when streamed; the response,
    or the list of chunks)."""
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=stream, **kw)
    else:
        out = client.completions.create(prompt=prompt, stream=stream, **kw)
    if not stream:
        return [c.message.content if chat else c.text for c in out.choices], out
    texts, chunks = {}, list(out)
    for c in (c for chunk in chunks for c in chunk.choices):
        texts[c.index] = texts.get(c.index, "") + ((c.delta.content or "") if chat else c.text)
    return [texts[i] for i in sorted(texts)], chunks


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_greedy_text_equals_generate_py_and_streams_join_to_it(served, client, alone, chat):
    """At temperature 0 the text is generate.py's for the same prompt (--chat: the chat template); the streamed
    chunks join to it; usage counts the prompt's tokens and the generated ones (a stop token included)."""
    prompt, n = "Write a haiku about the sea.", 12
    ids = alone.tok.encode_chat([{"role": "user", "content": prompt}]) if chat else alone.tok.encode(prompt)
    text, made = alone(ids, n)
    texts, one = ask(client, chat, prompt, model=served[0].name, max_tokens=n, temperature=0)
    assert texts == [text] and one.choices[0].finish_reason == ("length" if made == n else "stop")
    assert ask(client, chat, prompt, model=served[0].name, max_tokens=n, top_p=0)[0] == [text]  # (top_p 0: greedy)
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (len(ids), made)
    texts, chunks = ask(client, chat, prompt, True, model=served[0].name, max_tokens=n, temperature=0,
                        stream_options={"include_usage": True})
    assert texts == [text] and len(chunks) >= 3  # (the first token and a round, the rest, the usage)
    assert chunks[-1].choices == [] and chunks[-1].usage == one.usage
    assert chunks[-2].choices[0].finish_reason == one.choices[0].finish_reason


def test_sixteen_concurrent_clients_each_greedy_one_as_alone(served, client):
    """16 clients at once (8 rows: the others wait), completions and chat, streamed or not, greedy or sampled with a
    seed, with stop strings, n = 2: each choice equals its request sent alone."""
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):", "The sun is",
               "Water boils at", "My favourite colour is", "Hello"]

    def request(i, greedy):  # odd i: chat; i % 4 in (2, 3): streamed; i in (4, 6): n = 2
        kw = dict(max_tokens=4 + i % 5, stop=[".", "\n\n"] if i % 3 == 0 else None, n=2 if i in (4, 6) else 1,
                  temperature=0)
        if not greedy:
            kw.update(temperature=0.9, top_p=0.9, seed=i, extra_body={"top_k": 20})
        return ask(client, i % 2 == 1, prompts[i], i % 4 >= 2, model=served[0].name, **kw)[0]

    want = [request(i % 8, i < 8) for i in range(16)]  # each alone
    assert want[4][0] == want[4][1] and want[6][0] == want[6][1]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda j: request(j % 8, j < 8), range(16)))
    assert got == want and not served[0].llm.scheduler.live()


def test_a_client_gone_mid_stream_frees_its_row(served, client):
    srv, url = served[:2]
    body = {"model": srv.name, "prompt": "Count from one to one hundred: one, two, three,", "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        victim = wait_until(lambda: srv.llm.scheduler.running, what="the request to run")[0]
    wait_until(lambda: not srv.llm.scheduler.live() and not srv.llm.runner.rows and srv.live == 0, 30,
               "the row to be freed")
    assert victim.finish_reason == "abort" and len(victim.out) < 200
    again = client.completions.create(model=srv.name, prompt="Hello", max_tokens=3, temperature=0)
    assert again.choices[0].text and again.usage.completion_tokens <= 3


def test_a_client_gone_before_its_json_answer_frees_its_row(served):
    """Not streamed: the client closes its connection while its request runs; the request is aborted."""
    srv, url = served[:2]
    body = json.dumps({"model": srv.name, "prompt": "Count from one to one hundred: one, two, three,",
                       "max_tokens": 200, "temperature": 0})
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        victim = wait_until(lambda: srv.llm.scheduler.running, what="the request to run")[0]
    wait_until(lambda: not srv.llm.scheduler.live() and not srv.llm.runner.rows and srv.live == 0, 30,
               "the row to be freed")
    assert victim.finish_reason == "abort" and len(victim.out) < 200


def test_a_cancelled_handler_aborts_its_requests(served):
    """A handler cancelled from outside (a timeout middleware, a server's shutdown) aborts its requests too. (On a
    loop of its own, kept running until the engine's read-backs have come.)"""
    srv, stays = served[0], SimpleNamespace(receive=lambda: asyncio.Event().wait())  # (a client that never goes)
    body = server.Completion(model=srv.name, prompt="Count from one to one hundred: one, two, three,", max_tokens=200,
                             temperature=0)

    async def cancel():
        task = asyncio.ensure_future(srv.completions(body, stays))
        for _ in range(1500):  # (30 s at most)
            if srv.llm.scheduler.running:
                break
            await asyncio.sleep(0.02)
        victim = srv.llm.scheduler.running[0]
        task.cancel()
        for _ in range(1500):
            if srv.live == 0 and not srv.llm.scheduler.live():
                break
            await asyncio.sleep(0.02)
        return victim
    victim = asyncio.run(cancel())
    assert victim.finish_reason == "abort" and len(victim.out) < 200 and srv.live == 0


def test_a_developer_message_is_a_system_message(served, client):
    def answer(role):
        messages = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
        out = client.chat.completions.create(model=served[0].name, messages=messages, max_tokens=6, temperature=0)
        return out.choices[0].message.content
    assert answer("developer") == answer("system")


def test_an_assistant_message_without_content_is_an_empty_one(served, client):
    """A replayed assistant turn may carry "content": null (it made tool calls, which this server does not offer)."""
    def answer(content):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content},
                    {"role": "user", "content": "Hello"}]
        out = client.chat.completions.create(model=served[0].name, messages=messages, max_tokens=6, temperature=0)
        return out.choices[0].message.content
    assert answer(None) == answer("")


def test_a_field_the_server_ignores_is_not_checked(served):
    for endpoint, body in [("completions", '{"prompt": "x", "max_tokens": 1, "user": "\\ud800"}'),
                           ("chat/completions", '{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}], '
                                                '"max_tokens": 1}')]:
        response = httpx.post(f"{served[1]}/v1/{endpoint}", content=body, headers={"Content-Type": "application/json"},
                              timeout=30)
        assert response.status_code == 200, response.text


def test_streamed_logprobs_equal_the_answer_in_one_piece(served, client):
    """A stop string's first characters hold text back between chunks: the chunks' logprobs (text_offset too) still
    join to the unstreamed answer's."""
    kw = dict(model=served[0].name, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, logprobs=2, stop=[", 99"])
    one = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    joined = {k: sum((getattr(c.logprobs, k) for c in chunks if c.logprobs), []) for k in ("tokens", "text_offset")}
    assert len(chunks) > 2 and "".join(c.text for c in chunks) == one.text
    assert joined == {"tokens": one.logprobs.tokens, "text_offset": one.logprobs.text_offset}


def test_echo_logprobs_of_token_ids_equal_the_models_log_softmax(served, client, alone):
    """lm-evaluation-harness's loglikelihood request: a token-id prompt, echo, logprobs; then without echo, more
    tokens. Log-probabilities and the top alternatives equal log_softmax of the model's own forward."""
    ids = alone.tok.encode("The quick brown fox jumps over the lazy dog because")
    kw = dict(model=served[0].name, prompt=ids, temperature=0)
    got = client.completions.create(max_tokens=1, logprobs=3, echo=True, **kw)
    more = client.completions.create(max_tokens=5, logprobs=5, **kw)
    model, seq = alone.model, list(ids)
    model.setup_caches(1, 64)
    with torch.no_grad():
        for _ in range(6):  # greedy, one full forward a token: 5 generated, then the reference over all
            ref = model(torch.tensor([seq]), torch.arange(len(seq)))[0].float().log_softmax(-1)  # [S, V]
            seq.append(int(ref[-1].argmax()))
    seq.pop()
    lp = got.choices[0].logprobs
    assert lp.tokens == [alone.tok.decode([t]) for t in seq[:len(ids) + 1]] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert got.choices[0].text == alone.tok.decode(ids) + lp.tokens[-1]
    for j, (value, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:]), 1):  # position j-1 scores token j
        assert value == pytest.approx(ref[j - 1, seq[j]].item(), abs=2e-4)
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(ref[j - 1].topk(3).values.tolist(), abs=2e-4)
        assert top[lp.tokens[j]] == value  # (the chosen token is among them, as OpenAI gives it)
    out = more.choices[0].logprobs
    assert out.tokens == [alone.tok.decode([t]) for t in seq[len(ids):]] and out.text_offset[0] == 0
    for k, (value, top) in enumerate(zip(out.token_logprobs, out.top_logprobs), len(ids) - 1):
        assert value == pytest.approx(ref[k].max().item(), abs=2e-4)  # (greedy: the likeliest)
        assert sorted(top.values(), reverse=True) == pytest.approx(ref[k].topk(5).values.tolist(), abs=2e-4)


BAD = [  # (endpoint, body, status, param)
    ("completions", "{not json", 400, None),
    ("completions", {"max_tokens": 2}, 400, "prompt"),
    ("chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("completions", {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ("completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": -0.1}, 400, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("completions", {"prompt": "x", "max_tokens": LENGTH}, 400, None),  # (prompt + max_tokens beyond a row)
    ("completions", {"prompt": [1] * LENGTH}, 400, None),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("completions", {"prompt": [1, 49152]}, 400, None),
    ("completions", {"prompt": [-1]}, 400, None),
    ("completions", {"prompt": "x", "n": ROWS + 1}, 400, "n"),
    ("completions", {"prompt": ["x"] * (ROWS + WAITING + 1), "max_tokens": 1}, 400, "n"),  # (never fits: not 429)
    ("completions", {"prompt": ["x", "y", "z"], "n": ROWS}, 400, "n"),
    ("completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, None),
    ("completions", '{"prompt": "x\\ud800"}', 400, None),  # (a lone surrogate: no tokenizer takes it)
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD, ids=[f"{e}-{i}" for i, (e, *_) in enumerate(BAD)])
def test_bad_input_gets_its_status_and_openais_error_body(served, endpoint, body, status, param):
    response = httpx.post(f"{served[1]}/v1/{endpoint}", content=body if isinstance(body, str) else json.dumps(body),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert (error["code"] == "model_not_found") == (status == 404)
    assert not served[0].llm.scheduler.live() and served[0].live == 0  # (nothing submitted)


def test_bad_input_through_the_openai_client(served, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=served[0].name, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    assert httpx.get(f"{served[1]}/v1/nothing").json()["error"]["message"] == "Not Found"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the warm-up's error)
def test_health_after_a_failed_warm_up_says_the_engine_stopped(served, monkeypatch):
    srv = server.Server(served[0].llm, "x", 1)  # (its own engine thread; the served one's loop is untouched)
    monkeypatch.setattr(srv.llm, "warm_up", lambda progress=None: 1 / 0)
    srv.engine.start()
    srv.engine.join(30)
    with pytest.raises(server.APIError, match="the engine stopped"):
        srv.health()


def test_beyond_the_rows_and_max_waiting_a_request_gets_429(served):
    """With the engine held, rows + max-waiting requests are taken and one more gets 429; released, all finish."""
    srv, url = served[:2]
    hold, step = threading.Event(), srv.llm.step
    srv.llm.step = lambda: (hold.wait(30), step())[1]
    body = {"model": srv.name, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    post = lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # noqa: E731
    try:
        with ThreadPoolExecutor(ROWS + WAITING) as pool:
            taken = pool.map(post, range(ROWS + WAITING))
            wait_until(lambda: srv.live == ROWS + WAITING, 30, "the requests to be taken")
            refused = post(0)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
            hold.set()
            assert [r.status_code for r in taken] == [200] * (ROWS + WAITING)
    finally:
        hold.set()
        srv.llm.step = step


@pytest.mark.parametrize("flags, message", [
    (["--max-batch", "0"], "max_batch"), (["--max-waiting", "-1"], "--max-waiting"), (["--port", "70000"], "cannot listen"),
    (["--checkpoint", "/nonexistent"], "/nonexistent")])
def test_cli_bad_flags_are_one_error_line(capsys, default_ckpt, flags, message):
    code = server.main(["--checkpoint", str(default_ckpt), "--port", "0", "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error:") and err.count("\n") == 1 and message in err, err
