"""Speculative decoding through the real server: --speculative-config (n-gram and a draft
model), the same greedy and seeded text as a server without it (openai SDK, streamed and
not), a stop string inside a run of accepted drafts, vLLM's spec_decode counters in
/metrics, and a bad config refused at start naming the flag."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from server.config import parse_config
from tests.server.harness import (
    MODEL_NAME,
    LiveServer,
    completion_texts,
    make_config,
    pick_stop,
    serve_in_thread,
)

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'  # noqa: E501
PROMPTS = ["one two three one two three one two", "the cat sat on the mat the cat", "a b c d"]


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def completions(server: LiveServer, **extra: object) -> list[str]:
    return completion_texts(server, PROMPTS, 48, **extra)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_serves_the_same_text_and_counts_its_drafts(
    live: LiveServer, tiny_checkpoint: Path, method: str
) -> None:
    """n-gram lookup, and the served model as its own draft."""
    greedy = {"temperature": 0.0}
    seeded = {"temperature": 0.9, "seed": 1234}
    stop_at = pick_stop("".join(completions(live, **greedy)), 2)
    config = NGRAM
    if method == "draft_model":
        config = json.dumps(
            {"method": method, "model": str(tiny_checkpoint), "num_speculative_tokens": 3}
        )
    with serve_in_thread(make_config(tiny_checkpoint, speculative_config=config)) as spec:
        assert completions(spec, **greedy) == completions(live, **greedy)
        assert completions(spec, **seeded) == completions(live, **seeded)
        client = OpenAI(base_url=spec.v1, api_key="unused")
        stopped = [
            client.completions.create(
                model=MODEL_NAME, prompt=PROMPTS, max_tokens=48, stop=[stop_at], **greedy
            ).choices
            for client in (client, OpenAI(base_url=live.v1, api_key="unused"))
        ]
        assert [c.text for c in stopped[0]] == [c.text for c in stopped[1]]
        assert "stop" in [c.finish_reason for c in stopped[0]]
        # a grammar checks every draft token: the same text as without speculation
        before = counter(httpx.get(spec.base_url + "/metrics").text, "llm_spec_decode_num_drafts")
        for extra in ({"guided_regex": "(ab|cd){3,9}x"}, {"guided_regex": "[a-z ]{20,40}"}):
            constrained = [
                c.completions.create(
                    model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=48, extra_body=extra, **greedy
                )
                .choices[0]
                .text
                for c in (client, OpenAI(base_url=live.v1, api_key="unused"))
            ]
            assert constrained[0] == constrained[1]
            assert re.fullmatch(extra["guided_regex"], constrained[0]), constrained
        after = counter(httpx.get(spec.base_url + "/metrics").text, "llm_spec_decode_num_drafts")
        assert after > before  # the constrained requests speculated
        metrics = httpx.get(spec.base_url + "/metrics").text
    drafts = counter(metrics, "llm_spec_decode_num_drafts")
    proposed = counter(metrics, "llm_spec_decode_num_draft_tokens")
    accepted = counter(metrics, "llm_spec_decode_num_accepted_tokens")
    assert drafts > 0 and 0 < accepted <= proposed
    by_position = re.findall(
        r'^llm_spec_decode_num_accepted_tokens_per_pos(?:_total)?\{[^}]*position="(\d+)"\} (\S+)$',
        metrics,
        re.M,
    )
    assert sum(float(v) for _, v in by_position) == accepted
    assert counter(httpx.get(live.base_url + "/metrics").text, "llm_spec_decode_num_drafts") == 0


@pytest.mark.parametrize(
    "value",
    ['{"method": "ngram"}', '{"method": "medusa", "num_speculative_tokens": 2}', "ngram"],
)
def test_a_bad_speculative_config_is_refused_at_start(value: str) -> None:
    with pytest.raises(ValueError, match="--speculative-config: speculative_config"):
        parse_config(["--speculative-config", value], {})
    with pytest.raises(ValueError, match="LLM_SERVER_SPECULATIVE_CONFIG: speculative_config"):
        parse_config([], {"LLM_SERVER_SPECULATIVE_CONFIG": value})
