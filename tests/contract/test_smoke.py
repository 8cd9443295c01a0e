async def test_submit_and_claim(store):
    res = await store.submit_run("r1", "demo", "1", {"a": 1})
    assert res.created
    import datetime as dt
    claimed = await store.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 5)
    assert [c.run_id for c in claimed] == ["r1"]
