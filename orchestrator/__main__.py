from orchestrator.ops.cli import main

main()
