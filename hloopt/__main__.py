from hloopt.cli import run

run()
