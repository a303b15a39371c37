"""A load test for an OpenAI-compatible server (server.py, or another such as llama-cpp-python's): N clients stream M
chat completions in all, each client sending its next request as soon as its last one ends.

    python benchmarks/load.py --url http://127.0.0.1:8000 --clients 32 --requests 128 [--max-tokens 64] [--json OUT]

Per request: TTFT, the time to the first chunk with text; ITL, the inter-token latency after it: (the last chunk's
time - the first's) / (tokens - 1), tokens from the usage chunk (stream_options.include_usage) or, where a server
sends none, one a chunk with text. Over the run: p50 and p99 of both, output tok/s (every request's tokens over
the wall time from the first request sent to the last answer), and errors (a status other than 200, a broken stream,
no text: there must be none; the exit status is 1 otherwise). The prompts cycle through a fixed list; one request
before the run warms the server up.
"""
import argparse
import asyncio
import datetime
import json
import sys
import time

import httpx
import numpy as np

PROMPTS = [
    "Explain how a CPU cache works.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Describe the water cycle to a child.",
    "Give me a recipe for a vegetable soup.", "Why is the sky blue?", "List ten uses for a paperclip.",
    "Summarise the plot of Romeo and Juliet.", "How do vaccines train the immune system?",
    "Write a poem about autumn leaves.", "What is the difference between a list and a tuple in Python?",
    "Plan a three-day trip to Rome.", "How does a bicycle stay upright?", "Explain recursion with an example.",
    "What should I pack for a hiking trip?", "Describe how bread rises.",
]


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed request -> its TTFT, ITL and tokens (raises on an error)."""
    start, stamps, tokens = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no text streamed")
    tokens = tokens or len(stamps)
    return {"ttft": stamps[0] - start, "itl": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens}


async def run(url: str, clients: int, requests: int, body: dict) -> dict:
    """The load: `clients` workers take request numbers until `requests` are done -> the figures."""
    results, errors, next_one = [], [], iter(range(requests))
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one(client, url, {**body, "messages": [{"role": "user", "content": "Hello"}]})  # (warm-up, not timed)

        async def worker():
            for i in next_one:
                try:
                    results.append(await one(client, url, {**body, "messages": [
                        {"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}))
                except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
                    errors.append(f"request {i}: {e}")
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
    ttft, itl = [r["ttft"] for r in results], [r["itl"] for r in results if r["itl"] is not None]
    q = lambda xs, p: float(np.percentile(xs, p)) if xs else float("nan")  # noqa: E731
    tokens = sum(r["tokens"] for r in results)
    return {"requests": requests, "clients": clients, "errors": len(errors), "error_examples": errors[:3],
            "seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds,
            "tokens_per_request": tokens / max(len(results), 1), "ttft_s_p50": q(ttft, 50), "ttft_s_p99": q(ttft, 99),
            "itl_ms_p50": 1e3 * q(itl, 50), "itl_ms_p99": 1e3 * q(itl, 99)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Load test for an OpenAI-compatible server (streamed chat completions).")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=32, help="requests in flight at once (default: %(default)s)")
    p.add_argument("--requests", type=int, default=128, help="requests in all (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument("--model", default=None, help="the model field of the requests (default: none sent)")
    p.add_argument("--server", default="", help="what serves --url (its command line), recorded with the figures")
    p.add_argument("--json", help="append the record to this JSON list")
    a = p.parse_args(argv)
    if min(a.clients, a.requests, a.max_tokens) < 1:
        print("error: --clients, --requests and --max-tokens must be >= 1", file=sys.stderr)
        return 1
    body = {"max_tokens": a.max_tokens, "temperature": a.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": a.model} if a.model else {})}
    try:
        r = asyncio.run(run(a.url.rstrip("/"), a.clients, a.requests, body))
    except (httpx.HTTPError, RuntimeError) as e:  # (the warm-up request failed: no server there)
        print(f"error: {a.url}: {e}", file=sys.stderr)
        return 1
    r.update(url=a.url, server=a.server, max_tokens=a.max_tokens, temperature=a.temperature,
             date=str(datetime.date.today()), command="python " + " ".join(sys.argv))
    print(f"{r['requests']} requests, {r['clients']} clients, {r['errors']} errors, {r['seconds']:.1f} s: "
          f"{r['tok_s']:.1f} output tok/s ({r['tokens_per_request']:.1f} tokens a request); TTFT p50 "
          f"{r['ttft_s_p50']:.2f} s, p99 {r['ttft_s_p99']:.2f} s; ITL p50 {r['itl_ms_p50']:.1f} ms, p99 "
          f"{r['itl_ms_p99']:.1f} ms")
    for e in r["error_examples"]:
        print(f"  {e}", file=sys.stderr)
    if a.json:
        try:
            old = json.loads(open(a.json).read())
        except FileNotFoundError:
            old = []
        with open(a.json, "w") as f:
            json.dump(old + [r], f, indent=1)
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
