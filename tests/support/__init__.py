"""Test support shared by the unit and end-to-end suites (on ``sys.path`` via pytest.ini).

Each module holds one kind of helper that more than one test file needs:
waiting for asynchronous results, backend rigs, native fakes built with a C
compiler, tiny offline models and engine construction.
"""
