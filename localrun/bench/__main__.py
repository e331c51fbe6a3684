from localrun.bench.cli import main

raise SystemExit(main())
