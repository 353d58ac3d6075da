"""qlite's binary work-queue protocol (docs/qlite.md): one listener serving one work queue."""
