"""What ``[kv_events]`` refuses: an endpoint that is no ZMQ tcp/ipc address (a config error
naming the field), and an address already taken (the publisher says which)."""
from __future__ import annotations

import socket

import pytest

from tandem.config import ConfigError, load_config
from tandem.kv_events.publisher import KVEventPublisher, PublisherSettings


@pytest.mark.parametrize("field, value", [("endpoint", "http://127.0.0.1:5557"),
                                          ("replay_endpoint", "tcp://127.0.0.1"),
                                          ("endpoint", "tcp://127.0.0.1:55x")])
def test_an_endpoint_that_is_no_zmq_address_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"kv_events.{field}"):
        load_config(overrides={f"kv_events.{field}": value}, env={})


def test_an_address_in_use_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        settings = PublisherSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint=endpoint, topic="",
                                     buffer_steps=4, hwm=4, max_queue_size=4, medium="GPU")
        with pytest.raises(OSError, match=f"cannot bind {endpoint}"):
            KVEventPublisher(settings)
