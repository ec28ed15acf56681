from metrale.cli import main

raise SystemExit(main())
