"""Moved to `flowrl.contract.responses`; this name stays until every importer uses the contract."""

from flowrl.contract.responses import (
    EOS,
    LENGTH,
    STOP,
    Response,
    ResponseRules,
    prompt_rows,
    responses_of,
    to_rollout,
)

__all__ = ["EOS", "LENGTH", "STOP", "Response", "ResponseRules", "prompt_rows", "responses_of", "to_rollout"]
