"""Receiver test worker of the p2p transport: ``python p2p_worker.py OPTIONS_JSON
HOST PORT UPDATES [SPOIL]`` (SPOIL: a tensor its loads corrupt, see
``miles_transport_common.testing.spoiling_target``)."""

from __future__ import annotations

import sys

from miles_transport_common.staging import module_target
from miles_transport_common.testing import receiver_loop, spoiling_target
from miles_transport_p2p.config import P2POptions
from miles_transport_p2p.receiver import P2PReceiver


def main() -> None:
    """Connect to the sender, then take part in the given number of updates."""
    options = P2POptions.model_validate_json(sys.argv[1])
    receiver = P2PReceiver(options, (sys.argv[2], int(sys.argv[3])))
    spoil = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None
    receiver_loop(
        # the model adopts what arrives (no copy) in full staging; bucket staging copies
        lambda model: receiver.receive(
            module_target(model) if spoil is None else spoiling_target(model, spoil)
        ),
        lambda: receiver.version,
        int(sys.argv[4]),
    )
    receiver.close()


if __name__ == "__main__":
    main()
