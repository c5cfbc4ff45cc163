"""dsr1's tests: a package, so helpers (`tests.harness`, `tests.reference`) import like any module."""
