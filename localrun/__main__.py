from localrun.cli import main

raise SystemExit(main())
