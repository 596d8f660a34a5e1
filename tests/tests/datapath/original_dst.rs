//! The getsockopt hook that answers `SO_ORIGINAL_DST`: it leaves every other call as the
//! kernel answered it.
use super::*;

/// The getsockopt hook sees every getsockopt on the node: all calls it does not own must come
/// back exactly as the kernel answers them.
#[test]
fn getsockopt_hook_leaves_other_calls_untouched() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let listener = pod
        .run(|| TcpListener::bind((Ipv6Addr::UNSPECIFIED, 0)))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let target = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let client = pod.run(|| std::net::TcpStream::connect(target)).unwrap();
    let (accepted, _) = listener.accept().unwrap();

    let before = getsockopt_answers(&accepted, &client);
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    let after = getsockopt_answers(&accepted, &client);
    assert_eq!(before, after);
    datapath.uninstall().wait().unwrap();
}

/// An answer larger than a page that weir does not own reaches the caller whole. Kernels from 5.8
/// until 6.5 fail such a call with EFAULT when a getsockopt program leaves `optlen` above a page:
/// for every process on the node, since the hook is at the root cgroup.
#[test]
fn getsockopt_answers_larger_than_a_page_are_untouched() {
    let fixture = privileged!(DatapathNode::new());
    let pod = fixture.pod("app");
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    const GROUPS: usize = 2_000;
    let answer = thread::spawn(|| {
        // Credentials are per thread in the kernel: the raw syscall changes this thread's
        // groups only (glibc's setgroups would change the whole test process's).
        let groups: Vec<libc::gid_t> = (1..=GROUPS as libc::gid_t).collect();
        // SAFETY: `groups` holds GROUPS ids.
        let ret = unsafe { libc::syscall(libc::SYS_setgroups, GROUPS, groups.as_ptr()) };
        assert_eq!(ret, 0, "setgroups: {}", std::io::Error::last_os_error());
        let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut buf = vec![0u8; GROUPS * 4 + 4096];
        let mut optlen = buf.len() as libc::socklen_t;
        // SAFETY: buf holds optlen bytes.
        let ret = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                buf.as_mut_ptr().cast(),
                &mut optlen,
            )
        };
        assert_eq!(ret, 0, "SO_PEERGROUPS: {}", std::io::Error::last_os_error());
        buf.truncate(optlen as usize);
        buf
    })
    .join()
    .unwrap();
    assert_eq!(
        answer.len(),
        GROUPS * 4,
        "the whole answer, past the first page"
    );
    let last = u32::from_ne_bytes(answer[answer.len() - 4..].try_into().unwrap());
    assert_eq!(last, GROUPS as u32);
    datapath.uninstall().wait().unwrap();
}

/// What a handful of getsockopt calls return: SO_ORIGINAL_DST on sockets weir did not redirect
/// (both levels), a plain option, and a large-buffer call (optlen above a page).
fn getsockopt_answers(accepted: &impl AsRawFd, client: &impl AsRawFd) -> Vec<(i32, Vec<u8>)> {
    let calls = [
        (accepted.as_raw_fd(), libc::SOL_IP, 80, 128),
        (accepted.as_raw_fd(), libc::SOL_IPV6, 80, 128),
        (client.as_raw_fd(), libc::SOL_SOCKET, libc::SO_TYPE, 4),
        (client.as_raw_fd(), libc::SOL_IP, libc::IP_TOS, 4),
        (
            client.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_CONGESTION,
            8192,
        ),
    ];
    calls
        .into_iter()
        .map(|(fd, level, name, len)| {
            let mut buf = vec![0u8; len];
            let mut optlen = len as libc::socklen_t;
            // SAFETY: buf holds optlen bytes.
            let ret =
                unsafe { libc::getsockopt(fd, level, name, buf.as_mut_ptr().cast(), &mut optlen) };
            let result = if ret == 0 {
                0
            } else {
                std::io::Error::last_os_error().raw_os_error().unwrap()
            };
            buf.truncate(optlen as usize);
            (result, buf)
        })
        .collect()
}
