"""Receiver test worker of the broadcast transport: ``python broadcast_worker.py OPTIONS_JSON
HOST PORT RANK UPDATES``."""

from __future__ import annotations

import sys

from miles_transport_broadcast.config import BroadcastOptions
from miles_transport_broadcast.receiver import BroadcastReceiver
from miles_transport_common.staging import module_target
from miles_transport_common.testing import receiver_loop


def main() -> None:
    """Join the group, then take part in the given number of updates."""
    options = BroadcastOptions.model_validate_json(sys.argv[1])
    receiver = BroadcastReceiver(options, (sys.argv[2], int(sys.argv[3])), int(sys.argv[4]))
    # odd ranks adopt what arrives (no copy), even ranks copy it into their state dict
    adopt = receiver.rank % 2 == 1
    receiver_loop(
        lambda model: receiver.receive(module_target(model) if adopt else model.state_dict()),
        lambda: receiver.version,
        int(sys.argv[5]),
    )


if __name__ == "__main__":
    main()
