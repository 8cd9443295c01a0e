"""Helpers of ``bench/peers.py``: runledger, Absurd and DBOS on one durable throwaway cluster.

- ``cluster``: the cluster (fsync on), its databases, transaction counters;
- ``harness``: worker processes, one measured batch, the rate between 10 % and 90 %;
- ``rl_side``, ``absurd_side``, ``dbos_side``: each system's setup, submit and timestamps;
- ``rl_flow``, ``absurd_worker``, ``dbos_worker``: the code the worker processes run;
- ``report``: the table and the JSON.
"""
