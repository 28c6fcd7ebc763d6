#!/bin/sh
# The proxy image's entrypoint: write nginx.conf from the ADDNORM_* settings (service/front/nginx_conf.py; the arguments
# are its --listen and --upstream) under /tmp, then run nginx in the foreground with that prefix. The root
# filesystem stays read-only and nginx never needs root (a port above 1024, no user switch).
set -eu
mkdir -p /tmp/nginx
python -m addnorm.service.front.nginx_conf --prefix /tmp/nginx "$@" > /tmp/nginx/nginx.conf
exec nginx -e stderr -p /tmp/nginx -c /tmp/nginx/nginx.conf -g 'daemon off;'
