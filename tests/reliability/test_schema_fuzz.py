"""schemathesis against the server's own OpenAPI schema, over real HTTP on loopback: generated
valid and invalid requests for every operation, and not one answer may be a 5xx.

The server here has a 256-token context so that a generated ``max_tokens`` cannot make one
example run for minutes; everything else is the default configuration. The example count per
operation is bounded (``FUZZ_EXAMPLES``, raise it locally for a longer hunt).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.server.support import ServerHandle, engine_is_idle, make_engine, start_server, wait_for
from vision_serve.settings import ServerSettings

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))
UNSUPPORTED = (
    "echo",
    "best_of",
    "suffix",
)


@pytest.fixture(scope="module")
def fuzzed(checkpoint: Path) -> Iterator[ServerHandle]:
    engine = make_engine(str(checkpoint), max_model_len=256)
    handle = start_server(engine, ServerSettings())
    yield handle
    # after every generated request: alive, and nothing left behind
    assert engine.is_alive()
    assert wait_for(lambda: engine_is_idle(handle), timeout=30)
    assert httpx.get(handle.base_url + "/health").status_code == 200
    handle.stop()
    engine.shutdown()


def _operations(base_url: str) -> list:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_generated_request_gets_a_5xx(fuzzed: ServerHandle, mode: GenerationMode) -> None:
    """Positive: valid by the schema (the engine must serve or refuse them cleanly); negative:
    violating it (the door must refuse them with a 4xx)."""
    operations = _operations(fuzzed.base_url)
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    calls = 0
    statuses: Counter[int] = Counter()

    def served_model(case):
        """Positive bodies name the served model and leave out the fields we refuse by name,
        so they reach the engine instead of stopping at a 404 or a 400."""
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = fuzzed.model
            for field in UNSUPPORTED:  # refused by name (a 400 tested elsewhere)
                case.body.pop(field, None)
        return case

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode).map(served_model))
        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def fuzz(case) -> None:
            nonlocal calls
            calls += 1
            response = case.call(timeout=120)
            statuses[response.status_code] += 1
            if os.environ.get("FUZZ_DEBUG") and response.status_code == 400:
                print(response.json()["error"]["message"][:90])
            assert response.status_code < 500, (
                f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
                f"body: {str(case.body)[:500]}"
            )
            if response.status_code >= 400 and case.path.startswith("/v1/"):
                error = response.json()["error"]
                assert {"message", "type", "param", "code"} <= set(error)

        try:
            fuzz()
        except Unsatisfiable:  # nothing to violate (an operation without inputs)
            assert mode is GenerationMode.NEGATIVE
            continue
    print(f"{mode.value}: {calls} requests, statuses {dict(sorted(statuses.items()))}")
    assert calls >= FUZZ_EXAMPLES
