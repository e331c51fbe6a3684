from localrun.server.app import main

raise SystemExit(main())
