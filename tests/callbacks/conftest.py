"""Settings of the callback tests: Lightning's own deprecation noise is not what these tests are about."""

from __future__ import annotations


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's Config
    config.addinivalue_line("filterwarnings", "ignore:.*LeafSpec.*")
    config.addinivalue_line("filterwarnings", "ignore:.*does not have many workers.*")
    config.addinivalue_line("filterwarnings", "ignore:.*number of training batches.*")
