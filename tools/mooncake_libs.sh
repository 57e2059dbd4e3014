#!/bin/sh
# Mooncake's client and master link libibverbs, librdmacm and libnuma, even
# over TCP. Install the Debian packages that are missing when running as root
# with apt-get; otherwise say what is missing (the Mooncake tests then skip,
# naming it). Never fails the build: the Mooncake tier is optional.
missing=""
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)  # not on a user's PATH on Debian
for pair in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
    lib=${pair%%:*}
    pkg=${pair#*:}
    "$ldconfig" -p 2>/dev/null | grep -q "$lib" || missing="$missing $pkg"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing$missing for Mooncake"
    apt-get install -y -q $missing >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q $missing >/dev/null; } \
        || echo "make: could not install$missing; the Mooncake tests will be skipped"
else
    echo "make: Mooncake needs the Debian packages$missing (as root: apt-get install -y$missing);" \
         "until then the Mooncake tests are skipped"
fi
exit 0
