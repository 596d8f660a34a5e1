//! A sidecar pod's port and IP range lists, as the kernel side reads them: one `SIDECAR_PORTS`
//! entry per listed port, one `SIDECAR_RANGES` (LPM trie) entry per listed range, each keyed by
//! the pod's netns cookie and the list it belongs to.
use std::{borrow::Cow, collections::HashSet};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        HashMap, MapData,
    },
    Ebpf,
};
use ipnet::IpNet;
use weir_common::{list, maps, IpKey, PortKey, RangeKey};

use crate::datapath::kernel::programs;
use crate::workload::{AllOr, SidecarRedirect};

/// A pod's entries, to write at enrollment and remove at unenrollment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(in crate::datapath) struct ListEntries {
    ports: Vec<PortKey>,
    /// Prefix length and data of each LPM trie key, and its value.
    ranges: Vec<(u32, RangeKey, u8)>,
}

impl ListEntries {
    /// The entries of a sidecar pod's lists (none for an ambient pod), with its main routes and
    /// whether each leaves by an excluded interface (none unless it excludes interfaces);
    /// `Err` when there are more than one pod may have.
    pub(super) fn of(
        netns_cookie: u64,
        sidecar: Option<&SidecarRedirect>,
        routes: &[(IpNet, bool)],
    ) -> Result<Self> {
        let Some(sidecar) = sidecar else {
            return Ok(Self::default());
        };
        let mut entries = Self::default();
        let mut ports = |list: u8, ports: &[u16]| {
            for port in ports {
                entries.ports.push(PortKey::new(netns_cookie, list, *port));
            }
        };
        if let AllOr::Only(included) = &sidecar.include_inbound_ports {
            ports(list::INBOUND_INCLUDE, included);
        }
        ports(list::INBOUND_EXCLUDE, &sidecar.exclude_inbound_ports);
        ports(list::OUTBOUND_INCLUDE, &sidecar.include_outbound_ports);
        ports(list::OUTBOUND_EXCLUDE, &sidecar.exclude_outbound_ports);
        if let AllOr::Only(included) = &sidecar.include_outbound_ranges {
            for range in included {
                entries.add_range(netns_cookie, list::OUTBOUND_INCLUDE, range, 1);
            }
        }
        for range in &sidecar.exclude_outbound_ranges {
            entries.add_range(netns_cookie, list::OUTBOUND_EXCLUDE, range, 1);
        }
        for (destination, excluded) in routes {
            let value = match excluded {
                true => list::ROUTE_EXCLUDED,
                false => 1,
            };
            entries.add_range(netns_cookie, list::ROUTES, destination, value);
        }
        // A pod's share of the node-wide maps, which hold every pod at its full share: far more
        // than istio's annotations ever list.
        let (ports, ranges) = (entries.ports.len(), entries.ranges.len());
        if ports > list::PORTS_PER_POD as usize {
            bail!(
                "the pod's sidecar port lists have {ports} entries; weir holds at most {} per pod",
                list::PORTS_PER_POD
            );
        }
        if ranges > list::RANGES_PER_POD as usize {
            bail!(
                "the pod's sidecar IP range lists and routes have {ranges} entries; weir holds at \
                 most {} per pod",
                list::RANGES_PER_POD
            );
        }
        Ok(entries)
    }

    fn add_range(&mut self, netns_cookie: u64, list: u8, range: &IpNet, value: u8) {
        let (ip, prefix, v6) = match range {
            // Stored IPv4-mapped, behind the 96 bits of the mapping.
            IpNet::V4(net) => (
                IpKey::from_v4(net.network().octets()),
                96 + u32::from(net.prefix_len()),
                false,
            ),
            IpNet::V6(net) => (
                IpKey::from_v6(net.network().octets()),
                u32::from(net.prefix_len()),
                true,
            ),
        };
        let key = RangeKey::range(netns_cookie, list, ip, v6);
        self.ranges
            .push((RangeKey::BITS_BEFORE_IP + prefix, key, value));
    }
}

/// The two maps.
pub(in crate::datapath) struct SidecarLists {
    ports: HashMap<MapData, PortKey, u8>,
    ranges: LpmTrie<MapData, RangeKey, u8>,
}

impl SidecarLists {
    pub(in crate::datapath) fn take(ebpf: &mut Ebpf) -> Result<Self> {
        Ok(Self {
            ports: programs::take_map(ebpf, maps::SIDECAR_PORTS)?,
            ranges: programs::take_map(ebpf, maps::SIDECAR_RANGES)?,
        })
    }

    /// Writes a pod's entries, then removes those it had `before` and no longer has (`None`:
    /// not known, looked for): a re-enrolled pod is never without the entries both enrollments
    /// share.
    pub(super) fn write(
        &mut self,
        netns_cookie: u64,
        entries: &ListEntries,
        before: Option<&ListEntries>,
    ) -> Result<()> {
        for port in &entries.ports {
            self.ports
                .insert(port, 1, 0)
                .context("writing a sidecar port list entry")?;
        }
        for (prefix, range, value) in &entries.ranges {
            self.ranges
                .insert(&Key::new(*prefix, *range), value, 0)
                .context("writing a sidecar range list entry")?;
        }
        let before = self.known_or_found(before, netns_cookie);
        {
            let kept_ports: HashSet<&PortKey> = entries.ports.iter().collect();
            let kept_ranges: HashSet<(u32, RangeKey)> = entries
                .ranges
                .iter()
                .map(|(prefix, range, _)| (*prefix, *range))
                .collect();
            let stale = ListEntries {
                ports: before
                    .ports
                    .iter()
                    .filter(|port| !kept_ports.contains(port))
                    .copied()
                    .collect(),
                ranges: before
                    .ranges
                    .iter()
                    .filter(|(prefix, range, _)| !kept_ranges.contains(&(*prefix, *range)))
                    .copied()
                    .collect(),
            };
            self.remove(Some(&stale), netns_cookie);
        }
        Ok(())
    }

    /// Removes a pod's entries; where they are not known (a pod recovered from the pinned maps
    /// after a restart), every entry of its netns cookie is looked for.
    pub(super) fn remove(&mut self, entries: Option<&ListEntries>, netns_cookie: u64) {
        let entries = self.known_or_found(entries, netns_cookie);
        for port in &entries.ports {
            let _ = self.ports.remove(port);
        }
        for (prefix, range, _) in &entries.ranges {
            let _ = self.ranges.remove(&Key::new(*prefix, *range));
        }
    }

    /// `entries`, or where they are not known, every entry of the netns cookie in the maps.
    fn known_or_found<'a>(
        &self,
        entries: Option<&'a ListEntries>,
        netns_cookie: u64,
    ) -> Cow<'a, ListEntries> {
        match entries {
            Some(entries) => Cow::Borrowed(entries),
            None => Cow::Owned(self.entries_of(netns_cookie)),
        }
    }

    fn entries_of(&self, netns_cookie: u64) -> ListEntries {
        let cookie = netns_cookie.to_ne_bytes();
        ListEntries {
            ports: self
                .ports
                .keys()
                .filter_map(Result::ok)
                .filter(|port| port.netns_cookie == netns_cookie)
                .collect(),
            ranges: self
                .ranges
                .keys()
                .filter_map(Result::ok)
                .filter(|key| key.data().netns_cookie == cookie)
                // The value is not needed to remove the entry.
                .map(|key| (key.prefix_len(), key.data(), 0))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ports(count: u16) -> Vec<u16> {
        (1..=count).collect()
    }

    fn ranges(count: u32) -> Vec<IpNet> {
        (0..count)
            .map(|n| IpNet::new(std::net::Ipv4Addr::from(0x0a00_0000 + (n << 8)).into(), 24))
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn a_pod_gets_its_full_share_and_no_more() {
        let full = SidecarRedirect {
            exclude_inbound_ports: Vec::new(),
            exclude_outbound_ports: ports(list::PORTS_PER_POD as u16),
            exclude_outbound_ranges: ranges(list::RANGES_PER_POD),
            ..SidecarRedirect::default()
        };
        let entries = ListEntries::of(7, Some(&full), &[]).unwrap();
        assert_eq!(entries.ports.len(), list::PORTS_PER_POD as usize);
        assert_eq!(entries.ranges.len(), list::RANGES_PER_POD as usize);

        let one_port_more = SidecarRedirect {
            exclude_outbound_ports: ports(list::PORTS_PER_POD as u16 + 1),
            ..full.clone()
        };
        let error = ListEntries::of(7, Some(&one_port_more), &[]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the pod's sidecar port lists have 129 entries; weir holds at most 128 per pod"
        );
        // Routes count with the ranges.
        let route = [("192.168.0.0/16".parse().unwrap(), false)];
        let error = ListEntries::of(7, Some(&full), &route).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the pod's sidecar IP range lists and routes have 257 entries; weir holds at most \
             256 per pod"
        );
    }

    /// The node-wide maps the kernel makes from the object hold every pod at its full share, so
    /// that pods (of one namespace, say) at theirs leave the room every other pod needs.
    #[test]
    fn the_objects_list_maps_hold_every_pod_at_its_full_share() {
        let Some(object) = programs::parsed_object() else {
            return;
        };
        let size = |name: &str| object.maps[name].max_entries();
        assert!(
            size(maps::SIDECAR_PORTS) >= list::PODS_AT_FULL_SHARE * list::PORTS_PER_POD,
            "{}",
            size(maps::SIDECAR_PORTS)
        );
        assert!(
            size(maps::SIDECAR_RANGES) >= list::PODS_AT_FULL_SHARE * list::RANGES_PER_POD,
            "{}",
            size(maps::SIDECAR_RANGES)
        );
    }
}
