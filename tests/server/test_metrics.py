"""/metrics after a few requests: the engine histograms, counters and gauges, plausibly valued."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread
from tests.server.paced import paced_backend as fake_backend


def scrape(live: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(live.base_url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items())))
    return samples.get(key, 0.0)


def test_engine_metrics_count_each_request(live: LiveServer) -> None:
    before = scrape(live)
    usages = []
    for i in range(3):
        body = {"prompt": f"Metrics {i}", "max_tokens": 5, "ignore_eos": True}
        usages.append(httpx.post(live.v1 + "/completions", json=body, timeout=30).json()["usage"])
    body = {"prompt": "Metrics stream", "max_tokens": 5, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as response:
        response.read()
    after_single = scrape(live)
    body = {"prompt": "Metrics n", "max_tokens": 5, "ignore_eos": True, "n": 3, "seed": 1}
    assert httpx.post(live.v1 + "/completions", json=body, timeout=30).status_code == 200
    after = scrape(live)
    # n = 3: each sample's own 4 gaps (their tokens interleave, so one merged list would
    # count 3 * 5 - 1 = 14 gaps, most of them between different samples)
    itl = "llm_inter_token_latency_seconds_count"
    assert value(after, itl) - value(after_single, itl) == 3 * 4
    after = after_single

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for histogram in (
        "llm_time_to_first_token_seconds",
        "llm_e2e_request_latency_seconds",
        "llm_request_queue_time_seconds",
        "llm_request_prefill_time_seconds",
    ):
        assert delta(histogram + "_count") == 4, histogram
        assert 0 < delta(histogram + "_sum") < 4 * 30, histogram
    # 5 tokens each: 4 gaps between them per request
    assert delta("llm_inter_token_latency_seconds_count") == 4 * 4
    assert delta("llm_generation_tokens_total") == 4 * 5
    streamed_prompt = delta("llm_prompt_tokens_total") - sum(u["prompt_tokens"] for u in usages)
    assert streamed_prompt > 0
    assert delta("llm_requests_finished_total", finish_reason="length") == 4
    # TTFT can never exceed end-to-end latency
    assert delta("llm_time_to_first_token_seconds_sum") <= delta(
        "llm_e2e_request_latency_seconds_sum"
    )

    assert value(after, "llm_requests_running") == 0
    assert value(after, "llm_requests_waiting") == 0
    assert value(after, "llm_kv_cache_usage_perc") == 0
    assert value(after, "llm_engine_steps_total") > 0
    assert value(after, "llm_engine_memory_bytes", pool="kv_cache") > 0
    http = [k for k in after if k[0] == "http_requests_total"]
    assert any(("handler", "/v1/completions") in labels for _, labels in http)


def test_ttft_is_observed_at_the_first_token_not_at_the_end(tmp_path: Path) -> None:
    """A dashboard must see a long stream's TTFT while it streams, as vLLM records it.

    The engine is the orchestrator's fake with 50 ms steps, so the stream is
    certainly still open when the scrape is taken.
    """
    ttft = "llm_time_to_first_token_seconds_count"
    itl = "llm_inter_token_latency_seconds_count"
    e2e = "llm_e2e_request_latency_seconds_count"
    config = make_config(tmp_path, max_model_len=256)
    with serve_in_thread(config, loader=lambda: fake_backend(0.05)) as live:
        before = scrape(live)
        body = {"prompt": "Long stream", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            during = scrape(live)  # ~57 steps (~3 s) to go
            for _ in lines:
                pass
        after = scrape(live)
    assert value(during, ttft) - value(before, ttft) == 1
    assert value(during, itl) - value(before, itl) >= 2
    assert value(during, e2e) == value(before, e2e)
    assert value(after, ttft) - value(before, ttft) == 1
    assert value(after, itl) - value(before, itl) == 59
    assert value(after, e2e) - value(before, e2e) == 1


def test_prefix_cache_hits_are_counted_and_change_no_greedy_text(tiny_checkpoint: Path) -> None:
    """The same long prompt twice: the second finds its whole pages in the prefix cache
    (on by default), /metrics counts them, and the greedy text is the same."""
    with serve_in_thread(make_config(tiny_checkpoint)) as live:
        prompt = [5 + (7 * i) % 200 for i in range(70)]  # 4 whole blocks, the last kept open
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        texts = []
        for _ in range(2):
            before = scrape(live)
            response = httpx.post(live.base_url + "/v1/completions", json=body, timeout=60)
            texts.append(response.json()["choices"][0]["text"])
            after = scrape(live)
        assert texts[0] == texts[1]
        hits = value(after, "llm_prefix_cache_hits_total") - value(
            before, "llm_prefix_cache_hits_total"
        )
        queries = value(after, "llm_prefix_cache_queries_total") - value(
            before, "llm_prefix_cache_queries_total"
        )
        assert (hits, queries) == (4 * 16, 70)
        assert 0 < value(after, "llm_prefix_cache_usage_perc") <= 1
        assert value(after, "llm_kv_cache_usage_perc") == 0
        # 4 sequences x 8 pages x 16 positions x K and V x 2 layers x 2 kv heads x 16 dims
        # x 4 bytes
        assert value(after, "llm_engine_memory_bytes", pool="kv_cache") == 32 * 16 * 2 * (
            2 * 2 * 16 * 4
        )


def test_quantized_weights_and_an_8_bit_cache_show_in_memory_bytes(tiny_checkpoint: Path) -> None:
    """--quantization int8 --kv-cache-dtype fp8 in bfloat16: /metrics gives the weights'
    bytes (<= 0.55x the bfloat16 params) and the KV cache's (0.5x bfloat16 pages: 4
    sequences x 8 pages x 16 positions x K and V x 2 layers x 2 kv heads x 16 dims x 1
    byte), and the quantized model answers."""
    from engine.checkpoint import load_params
    from engine.config import load_model_config
    from engine.quant import param_bytes

    bf16 = param_bytes(load_params(tiny_checkpoint, load_model_config(tiny_checkpoint), "bfloat16"))
    config = make_config(
        tiny_checkpoint, dtype="bfloat16", quantization="int8", kv_cache_dtype="fp8"
    )
    with serve_in_thread(config) as live:
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        response = httpx.post(live.base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        after = scrape(live)
    weights = value(after, "llm_engine_memory_bytes", pool="weights")
    assert 0 < weights <= 0.55 * bf16
    assert value(after, "llm_engine_memory_bytes", pool="kv_cache") == 32 * 16 * 2 * (2 * 2 * 16)
