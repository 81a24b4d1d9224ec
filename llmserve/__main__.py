from llmserve.cli import main

raise SystemExit(main())
