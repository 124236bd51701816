from paged_video.bench.cli import main

raise SystemExit(main())
