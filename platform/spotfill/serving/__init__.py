"""spotfill's Ray Serve generation app (above fill-in, generation, training and storage: it builds on all of
them): its arguments (args.py), the application (app.py: `serve run serving.app:app`, whose top-level
serving/app.py re-exports it) and deploying it on a cluster (deploy.py: `spotfill serve`, the demo)."""
