"""astrai.sandbox: running untrusted code (model-written solutions) against unit tests in a confined child process
(`execute.run_tests`; `harness` runs inside the child, `process` supervises it, `code_tests` parses MBPP-style
asserts). Standard library only."""
