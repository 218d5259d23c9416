"""Schemathesis against the server's own /openapi.json, every route, through real HTTP.

Every generated request (valid and invalid per the schema) must get no 5xx, every 4xx must
be OpenAI's error shape, every response must match what the schema documents, and the
server must still be healthy at the end. The run is bounded: FUZZ_EXAMPLES cases per
route and generation mode (default 40, about a minute on two cores; raise it for a manual
run, e.g. FUZZ_EXAMPLES=500). Cases are derandomized, so CI sees the same inputs every
run; FUZZ_SEED picks another sequence.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi import checks as openapi_checks

from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
SEED = os.environ.get("FUZZ_SEED")
CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
]
ERROR_FIELDS = {"message": (str,), "type": (str,), "param": (str, type(None))}
ERROR_FIELDS["code"] = (str, type(None))


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve_in_thread(make_config(tiny_checkpoint)) as live:
        yield live


def error_shape_problem(content: bytes) -> str | None:
    """Why a 4xx body is not `{"error": {"message", "type", "param", "code"}}`, or None."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"}:
        return f"no error object: {body!r}"[:300]
    if set(error) != set(ERROR_FIELDS):
        return f"error fields {sorted(error)}"
    for name, types in ERROR_FIELDS.items():
        if not isinstance(error[name], types):
            return f"error.{name} is {type(error[name]).__name__}"
    return None


class Tally:
    """What the fuzzing saw: cases per (operation, mode, status), and every failure."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, int], int] = {}
        self.problems: list[str] = []

    @property
    def cases(self) -> int:
        return sum(self.seen.values())

    def report(self) -> str:
        lines = [f"schemathesis: {self.cases} cases"]
        for (label, mode, status), count in sorted(self.seen.items()):
            lines.append(f"  {label} [{mode}] {status}: {count}")
        return "\n".join(lines)


def fuzz(
    operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str, tally: Tally
) -> None:
    """Send up to EXAMPLES generated requests for one operation and check each response."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=SEED is None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: every failure is listed
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), real_model=st.booleans())
    def run(case: schemathesis.Case, real_model: bool) -> None:
        if real_model:  # past the 404 for an unknown model, into the handlers
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL_NAME
            if case.path_parameters and "model_id" in case.path_parameters:
                case.path_parameters["model_id"] = MODEL_NAME
        response = case.call(base_url=base_url, timeout=120)
        key = (operation.label, mode.value, response.status_code)
        tally.seen[key] = tally.seen.get(key, 0) + 1
        sent = f"{case.method} {case.formatted_path} body={_body(case)}"
        if response.status_code >= 500:
            tally.problems.append(f"{response.status_code} for {sent}: {response.content[:300]!r}")
        elif response.status_code >= 400:
            why = error_shape_problem(response.content)
            if why:
                tally.problems.append(f"{response.status_code} shape ({why}) for {sent}")
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:  # every check that failed, each with its reason
            tally.problems.append(f"{sent}: {str(group)[:1000]}")

    if SEED is not None:
        run = seed(int(SEED))(run)
    try:
        run()
    except Unsatisfiable:  # a string path parameter: every value is valid, none to break
        assert mode is GenerationMode.NEGATIVE, operation.label


def test_schema_fuzz(server: LiveServer, record_property: Callable[[str, object], None]) -> None:
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 17, [op.label for op in operations]
    tally = Tally()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, mode, server.base_url, tally)
    print(tally.report())
    record_property("fuzz_cases", tally.cases)
    assert not tally.problems, (
        f"{len(tally.problems)} of {tally.cases} cases failed:\n" + "\n".join(tally.problems)
    )
    assert tally.cases >= 2 * EXAMPLES  # the two POST routes at least, in both modes
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.base_url + "/ready", timeout=10).status_code == 200


def _body(case: schemathesis.Case) -> str:
    try:
        return json.dumps(case.body, ensure_ascii=True)[:2000]
    except (TypeError, ValueError):
        return repr(case.body)[:2000]
