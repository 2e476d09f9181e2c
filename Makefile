# Shortcuts for the two set-up commands of README.md (the scripts work without make).
.PHONY: run test
run:
	bash scripts/run.sh
test:
	bash scripts/test.sh
