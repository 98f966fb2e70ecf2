"""The client of an embedded engine server: SGLang's (``miles_engine_client.EngineClient``,
the same client speaks to real SGLang), plus the calls of the embedded engine's own extensions
that the core makes when the engine's record declares them."""

from __future__ import annotations

from typing import Any

from miles_engine_client import EngineClient, EngineHTTPError


class EmbeddedClient(EngineClient):
    """:class:`EngineClient` with ``weights_from_peer``
    (:class:`miles_core.contracts.PeerWeightsClient`)."""

    async def pull_weights(self, source: str, *, timeout_s: float) -> dict[str, Any]:
        """``POST /miles/pull_weights``: copy the weights the engine at ``source`` serves and
        serve them under its version; raises when the copy is refused."""
        answer = await self.request(
            "POST", "/miles/pull_weights", {"source": source, "timeout_s": timeout_s}
        )
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise EngineHTTPError("/miles/pull_weights", 200, f"unexpected answer {answer!r}")
        return answer
