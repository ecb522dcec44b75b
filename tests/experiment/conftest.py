"""Fixtures shared by the experiment's tests."""

import socket

import pytest


@pytest.fixture
def free_port():
    """A function returning a free TCP port on 127.0.0.1 (for torch.distributed's rendezvous)."""

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return port
