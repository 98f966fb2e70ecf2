"""Receiver test worker of the colocated transport: ``python colocated_worker.py OPTIONS_JSON
HOST PORT UPDATES``."""

from __future__ import annotations

import sys

from miles_transport_colocated.config import ColocatedOptions
from miles_transport_colocated.receiver import ColocatedReceiver
from miles_transport_common.staging import module_target
from miles_transport_common.testing import receiver_loop


def main() -> None:
    """Connect to the sender, then take part in the given number of updates."""
    options = ColocatedOptions.model_validate_json(sys.argv[1])
    receiver = ColocatedReceiver(options, (sys.argv[2], int(sys.argv[3])))
    receiver_loop(
        # the model adopts what arrives (no copy) in full staging; bucket staging copies
        lambda model: receiver.receive(module_target(model)),
        lambda: receiver.version,
        int(sys.argv[4]),
    )
    receiver.close()


if __name__ == "__main__":
    main()
