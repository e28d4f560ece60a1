"""Fixtures of the cluster tier: test hosts (network namespaces) and Ray nodes on them.

``make_test_hosts(n)`` returns ``n`` fresh hosts, torn down after the test whatever happens
(``module_test_hosts`` is the same per module, to share a slow-to-start cluster). Where the
machine cannot make them (not root, no ``ip``, ``ip netns add`` refused) they skip with the
reason, shown by ``pytest -ra``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from netns import HostsUnavailable, RayNodes, TestHosts, cannot_make_hosts


def hosts_factory() -> Iterator[Callable[[int], TestHosts]]:
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(reason)
    made: list[TestHosts] = []

    def make(count: int = 2) -> TestHosts:
        hosts = TestHosts(count)
        made.append(hosts)  # registered first: a half-made set is torn down too
        try:
            return hosts.create()
        except HostsUnavailable as error:
            pytest.skip(f"cannot make test hosts here: {error}")

    yield make
    errors = []
    for hosts in reversed(made):
        try:
            hosts.close()
        except Exception as error:  # close every set before reporting
            errors.append(error)
    if errors:
        raise errors[0]


@pytest.fixture
def make_test_hosts() -> Iterator[Callable[[int], TestHosts]]:
    yield from hosts_factory()


@pytest.fixture(scope="module")
def module_test_hosts() -> Iterator[Callable[[int], TestHosts]]:
    yield from hosts_factory()


@pytest.fixture
def ray_nodes(make_test_hosts: Callable[[int], TestHosts]) -> Iterator[RayNodes]:
    """Ray nodes (one token-auth cluster) killed after the test, before its hosts go."""
    nodes = RayNodes()
    yield nodes
    nodes.stop()
