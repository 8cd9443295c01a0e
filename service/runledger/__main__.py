from runledger.cli import run

run()
