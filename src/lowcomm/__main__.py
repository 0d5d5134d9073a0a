from lowcomm.cli import main

raise SystemExit(main())
